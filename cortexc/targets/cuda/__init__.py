"""The CUDA target: nvcc. `target.py` is its compile side; `host.py` (the host side shared by the GPU and the
emulator), `executor.py` (PyCUDA on a GPU), `emulated.py` (g++ against `cuda_emu.h`) its host side."""
