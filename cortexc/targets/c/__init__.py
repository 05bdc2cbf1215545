"""The C target: gcc with OpenMP. `target.py` is its compile side; `executor.py`, `threads.py` its host side."""
