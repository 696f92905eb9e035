"""What a model is: `ModelInfo`, read from a folder (config and safetensors headers) or a config."""
