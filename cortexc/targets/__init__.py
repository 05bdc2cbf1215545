"""The kernel targets, one folder each: its compile side (`target.py`: the `Target`, its knobs and its
program passes), its templates (`templates/`: the dialect macros the shared kernel skeleton calls, and the
driver), its host side (executors, builders, headers) and `backends.py` (the devices that run it, for
`cortexc.runtime.backends`). Registering a target is its name here; nothing else names it."""

from __future__ import annotations

#: the registered targets, in the order their kernel sources are generated and their devices listed
NAMES: tuple[str, ...] = ("c", "cuda")
