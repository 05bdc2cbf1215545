"""The compiler's version: part of every cache key and of `cell.json`. Its own module, at the floor every
layer may import, so that nothing below the package's `__init__` imports the package for it."""

__version__ = "0.1.0"
