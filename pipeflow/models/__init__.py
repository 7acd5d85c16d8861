"""Built-in models as layer lists: `gpt` and `mlp`."""
