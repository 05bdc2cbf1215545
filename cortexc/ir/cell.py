"""The IR: a cell as small frozen dataclasses of SSA values.

A `Body` is an ordered tuple of `Value`s; a value's ``args`` are indices of
earlier values of the same body, so every body is in SSA form and in
evaluation order. Every value knows its resolved integer shape and its
`Domain` (once per cell, per node, or per child). Nothing here is mutated:
passes build new cells with `dataclasses.replace`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from cortexc.errors import SourceLoc
from cortexc.ir.ops import CHILD_READ_OPS, Domain, Op, Shape


class DType(enum.Enum):
    F32 = "f32"
    I32 = "i32"


@dataclass(frozen=True)
class Value:
    """One SSA value: ``op(args...)`` with its shape, domain and attributes."""

    op: Op
    args: tuple[int, ...]
    shape: Shape
    domain: Domain
    attrs: tuple[tuple[str, Any], ...] = ()
    dtype: DType = DType.F32
    label: str = ""  # the user's name for it, if it was assigned to one (for dumps)
    loc: SourceLoc | None = field(default=None, compare=False)

    def attr(self, key: str) -> Any:
        for name, value in self.attrs:
            if name == key:
                return value
        raise KeyError(f"{self.op.value} has no attribute {key!r}")

    @property
    def name(self) -> str:
        """The declared name an input/param/state op refers to."""
        return self.attr("name")


class BodyKind(enum.Enum):
    LEAF = "leaf"  # nodes without children
    NODE = "node"  # nodes with children (or every node, before specialisation without a leaf block)
    OUTPUT = "output"  # a read-out after the recursion
    PRE = "pre"  # what `hoist` took out of NODE: computed for all internal nodes before the recursion
    GRAD = "grad"  # a reverse body made by `autodiff`: recomputes its forward body, then its adjoints


@dataclass(frozen=True)
class Body:
    """Straight-line SSA code and the named results it produces.

    For LEAF and NODE bodies the results are the states (all of them, in
    declaration order); for an OUTPUT body, the single output.
    """

    kind: BodyKind
    values: tuple[Value, ...]
    results: tuple[tuple[str, int], ...]

    def result(self, name: str) -> int:
        for result_name, index in self.results:
            if result_name == name:
                return index
        raise KeyError(name)

    def reads_children(self) -> bool:
        return any(v.op in CHILD_READ_OPS for v in self.values)


class Structure(enum.Enum):
    TREE = "tree"
    DAG = "dag"


class InitKind(enum.Enum):
    ZEROS = "zeros"
    ONES = "ones"
    XAVIER = "xavier"
    UNIFORM = "uniform"
    NORMAL = "normal"


@dataclass(frozen=True)
class Init:
    kind: InitKind
    args: tuple[float, ...] = ()

    def __str__(self) -> str:
        if not self.args:
            return self.kind.value
        return f"{self.kind.value}({', '.join(repr(a) for a in self.args)})"


@dataclass(frozen=True)
class ParamDecl:
    name: str
    shape: Shape
    init: Init


@dataclass(frozen=True)
class InputDecl:
    """A per-node input: a float32 vector, or (``index_range`` set) an int32 in [0, range)."""

    name: str
    shape: Shape
    index_range: int | None = None

    @property
    def is_index(self) -> bool:
        return self.index_range is not None


@dataclass(frozen=True)
class StateDecl:
    name: str
    shape: Shape


@dataclass(frozen=True)
class Output:
    name: str
    shape: Shape
    at_root: bool
    body: Body


@dataclass(frozen=True)
class Gradients:
    """The reverse bodies `autodiff` adds, one per forward body.

    Each recomputes its forward body for one node (from the saved states of
    its children, its inputs and the params) and then propagates the
    adjoints of the body's results, which it reads as `adjoint` values. Its
    results are named ``d_param/W``, ``d_input/x`` (per node),
    ``d_embed/E/w`` (the gradient of row ``w`` of ``E``), ``d_child/h``
    (per child), ``d_child_at/k/h``, ``d_hoisted/pre0`` and, in outputs,
    ``d_state/h``: what flows to the params, the inputs, the children, the
    pre body and the node's own states. Param gradients are per node and
    summed over the nodes by whoever runs the body.
    """

    leaf: Body
    node: Body
    pre: Body | None
    outputs: tuple[Body, ...]


@dataclass(frozen=True)
class Cell:
    """One cell: declarations plus the leaf/node bodies and read-outs.

    ``leaf`` is None when nodes without children run ``node`` (the cell had no
    leaf block and has not been specialised yet). ``pre`` is set by `hoist`: the
    children-independent heavy values of ``node`` (input projections, look-ups),
    computed for every internal node at once; ``node`` reads them as `hoisted`.
    """

    name: str
    structure: Structure
    arity: int | None
    dims: tuple[tuple[str, int], ...]
    params: tuple[ParamDecl, ...]
    inputs: tuple[InputDecl, ...]
    states: tuple[StateDecl, ...]
    node: Body
    leaf: Body | None = None
    outputs: tuple[Output, ...] = ()
    pre: Body | None = None
    grads: Gradients | None = None
    source: str = ""  # the .cell file it came from, for messages

    def param(self, name: str) -> ParamDecl:
        return _find(self.params, name, "param")

    def input(self, name: str) -> InputDecl:
        return _find(self.inputs, name, "input")

    def state(self, name: str) -> StateDecl:
        return _find(self.states, name, "state")

    def output(self, name: str) -> Output:
        return _find(self.outputs, name, "output")

    def bodies(self) -> list[Body]:
        found = [self.node] if self.leaf is None else [self.leaf, self.node]
        if self.pre is not None:
            found.insert(0, self.pre)
        return found + [out.body for out in self.outputs]


def _find(items: tuple[Any, ...], name: str, what: str) -> Any:
    for item in items:
        if item.name == name:
            return item
    raise KeyError(f"no {what} named {name!r}")
