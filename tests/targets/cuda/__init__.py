"""The CUDA target: its emulator, kernels, column split and host side (a GPU where one is lent)."""
