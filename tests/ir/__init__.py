"""The IR: the op registry, the interpreter, autodiff."""
