"""Language features end to end: each through the interpreter, the C and the emulated CUDA."""
