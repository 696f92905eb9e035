"""The serving engine side: continuous-batching scheduler, engine thread and engine process."""
