"""The `Executor` protocol: what a backend's runner offers the model classes.

An executor runs one compiled cell of a package. It owns no model knowledge:
everything it needs (the ABI, the packed weights' layout, result shapes) is
the cell's entry of the package's `cell.json`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from cortexc.runtime.philox import EVAL, Dropout


class Executor(Protocol):
    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Take (a full set of) params; weights are packed here, once, not per call."""
        ...

    def forward(
        self,
        lin: Any,
        inputs: Mapping[str, np.ndarray],
        keep: bool = False,
        host: bool = True,
        dropout: Dropout = EVAL,
    ) -> tuple[dict[str, Any], Any]:
        """States and outputs of a linearized forest for validated inputs, in `dropout`'s mode; with ``keep``,
        also what `backward` needs (else None; it replays the forward's dropout masks)."""
        ...

    def backward(
        self, saved: Any, upstream: Mapping[str, np.ndarray], param_shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, np.ndarray]:
        """Gradients of every param and float input, from what `forward` kept and upstream gradients."""
        ...
