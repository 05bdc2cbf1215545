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
from cortexc.ir.ops import CHILD_READ_OPS, Domain, DType, Op, Shape
from cortexc.runtime.signature import CellSignature, InputSig, StateSig


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


class GradKind(enum.Enum):
    """Where a gradient body's result flows (the value is its spelling in dumps)."""

    PARAM = "d_param"  # a param's gradient, per node (summed over the nodes by whoever runs the body)
    INPUT = "d_input"  # a float input's row for this node
    EDGE_INPUT = "d_edge_input"  # a float edge input's row for the edge to each child (one row per child)
    EMBED = "d_embed"  # the looked-up row of a table (`index` names the index input that chose it)
    CHILD = "d_child"  # a state of every child (one row per child)
    CHILD_AT = "d_child_at"  # a state of child `k`
    PREV = "d_prev"  # a graph cell: the node's own state one step earlier
    HOISTED = "d_hoisted"  # this node's row of a result of the `pre` body
    STATE = "d_state"  # the node's own state (from a read-out)


@dataclass(frozen=True)
class GradTarget:
    """The key of a GRAD body's result: what the gradient is of. Prints as ``d_child_at/k/h``."""

    kind: GradKind
    name: str  # the param, input, table, state or hoisted result
    k: int | None = None  # CHILD_AT: which child
    index: str | None = None  # EMBED: the index input

    def __post_init__(self) -> None:
        if (self.k is not None) != (self.kind == GradKind.CHILD_AT):
            raise ValueError(f"{self.kind.value} needs a child position k exactly when it is d_child_at")
        if (self.index is not None) != (self.kind == GradKind.EMBED):
            raise ValueError(f"{self.kind.value} needs an index input exactly when it is d_embed")

    def __str__(self) -> str:
        if self.kind == GradKind.CHILD_AT:
            return f"{self.kind.value}/{self.k}/{self.name}"
        if self.kind == GradKind.EMBED:
            return f"{self.kind.value}/{self.name}/{self.index}"
        return f"{self.kind.value}/{self.name}"


#: a body's result key: a state, output or hoisted name (forward bodies), or a gradient target (GRAD bodies)
ResultKey = str | GradTarget


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
    results: tuple[tuple[ResultKey, int], ...]

    def result(self, name: ResultKey) -> int:
        for result_name, index in self.results:
            if result_name == name:
                return index
        raise KeyError(name)

    @property
    def named_results(self) -> tuple[tuple[str, int], ...]:
        """The results of a forward body, by state, output or hoisted name."""
        named = tuple((key, index) for key, index in self.results if isinstance(key, str))
        if len(named) != len(self.results):
            raise TypeError(f"a {self.kind.value} body with gradient results")
        return named

    @property
    def grad_results(self) -> tuple[tuple[GradTarget, int], ...]:
        """The results of a GRAD body, by gradient target."""
        targets = tuple((key, index) for key, index in self.results if isinstance(key, GradTarget))
        if len(targets) != len(self.results):
            raise TypeError(f"a {self.kind.value} body with named results")
        return targets

    def reads_children(self) -> bool:
        return any(v.op in CHILD_READ_OPS for v in self.values)


class Structure(enum.Enum):
    """What a cell runs on; stages ask its properties, not which kind it is."""

    TREE = "tree"
    DAG = "dag"
    GRAPH = "graph"

    @property
    def shares_children(self) -> bool:
        """A child may have several parents, possibly in one level (its gradients are added atomically)."""
        return self is not Structure.TREE

    @property
    def has_steps(self) -> bool:
        """Cycles allowed: the node body runs `steps` times over every node (`prev` reads the step before)."""
        return self is Structure.GRAPH


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


#: inputs and states are declared exactly as the runtime's signature describes them (one definition)
InputDecl = InputSig
StateDecl = StateSig


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
    results are keyed by `GradTarget`: what flows to the params, the inputs
    (and looked-up table rows), the children, the pre body and, in outputs,
    the node's own states. Param gradients are per node and summed over the
    nodes by whoever runs the body.
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
    down: bool = False  # roots first: the bodies read a node's parents as its children (`runtime.topdown`)
    steps: int | None = None  # a graph cell's T: its leaf body (`init`) is step 0, its node body steps 1..T

    @property
    def read_arity(self) -> int | None:
        """How many nodes a body reads by position (`child_state_at`): the arity, or for a down cell on a tree
        its one parent (position 0)."""
        if self.down:
            return None if self.structure.shares_children else 1
        return self.arity

    @property
    def shares_read_nodes(self) -> bool:
        """Whether a node may be read by several nodes of one level (its gradient is added atomically): a DAG's
        shared children, and in a down cell any parent with several children."""
        return self.structure.shares_children or self.down

    def param(self, name: str) -> ParamDecl:
        return _find(self.params, name, "param")

    def signature(self) -> CellSignature:
        """The runtime's view of this cell (`ir.runtime_signature.cell_signature`): what the runtime's checks take."""
        from cortexc.ir.runtime_signature import cell_signature

        return cell_signature(self)

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
