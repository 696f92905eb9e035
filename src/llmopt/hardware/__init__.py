"""The machine: host and GPU probes, the GPU spec table and compatibility rules."""
