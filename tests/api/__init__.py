"""The user's surfaces: the CLI, export, PyTorch, training and the peers' comparisons."""
