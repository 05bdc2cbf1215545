"""`BodyBuilder`: how every stage that makes IR bodies (lowering, specialize, hoist, autodiff) builds them.

It lives in the IR, not the front end, so passes build bodies without depending on the parser.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cortexc.errors import SourceLoc
from cortexc.ir import cell as ir
from cortexc.ir.cell import BodyKind, DType, Value
from cortexc.ir.ops import Domain, Op, Shape


class BodyBuilder:
    """Appends values in SSA order, sharing identical ones, and labels them for dumps."""

    def __init__(self) -> None:
        self.values: list[Value] = []
        self._index: dict[tuple[Any, ...], int] = {}
        self._labels: dict[int, str] = {}

    def add(
        self,
        op: Op,
        args: tuple[int, ...],
        shape: Shape,
        domain: Domain,
        attrs: tuple[tuple[str, Any], ...] = (),
        dtype: DType = DType.F32,
        loc: SourceLoc | None = None,
    ) -> int:
        key = (op, args, shape, domain, attrs, dtype)
        if key not in self._index:
            self._index[key] = len(self.values)
            self.values.append(Value(op, args, shape, domain, attrs, dtype, loc=loc))
        return self._index[key]

    def label(self, index: int, name: str) -> None:
        self._labels.setdefault(index, name)

    def finish(self, kind: BodyKind, results: Sequence[tuple[ir.ResultKey, int]]) -> ir.Body:
        """The body with only the values some result needs, renumbered in order."""
        live = set()
        stack = [index for _, index in results]
        while stack:
            index = stack.pop()
            if index not in live:
                live.add(index)
                stack.extend(self.values[index].args)
        renumber: dict[int, int] = {}
        kept: list[Value] = []
        for index, value in enumerate(self.values):
            if index in live:
                renumber[index] = len(kept)
                args = tuple(renumber[a] for a in value.args)
                kept.append(replace(value, args=args, label=self._labels.get(index, "")))
        return ir.Body(kind, tuple(kept), tuple((name, renumber[i]) for name, i in results))
