"""The syntax tree of a `.cell` file: frozen dataclasses, each with its location.

It mirrors the text (no names resolved, no shapes known); `check` and
`lower` turn it into the typed IR.
"""

from __future__ import annotations

from dataclasses import dataclass

from cortexc.errors import SourceLoc


@dataclass(frozen=True)
class Number:
    text: str
    loc: SourceLoc

    @property
    def value(self) -> float:
        return float(self.text)

    @property
    def is_int(self) -> bool:
        return self.text.isdigit()


@dataclass(frozen=True)
class Name:
    name: str
    loc: SourceLoc


@dataclass(frozen=True)
class Binary:
    """``left op right``; ``loc`` is the operator's position (where a mismatch is reported)."""

    op: str  # one of + - * / @
    left: Expr
    right: Expr
    loc: SourceLoc


@dataclass(frozen=True)
class Neg:
    operand: Expr
    loc: SourceLoc


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple[Expr, ...]
    loc: SourceLoc


@dataclass(frozen=True)
class Slice:
    """``base[lo:hi]``; a missing bound is None (start or end of the vector)."""

    base: Expr
    lo: Expr | None
    hi: Expr | None
    loc: SourceLoc  # the opening bracket


@dataclass(frozen=True)
class Index:
    """``base[index]``: an embedding look-up ``E[w]``."""

    base: Expr
    index: Expr
    loc: SourceLoc


@dataclass(frozen=True)
class ChildAll:
    """``child.state``: one value per child."""

    state: str
    loc: SourceLoc


@dataclass(frozen=True)
class ChildAt:
    """``child[k].state``: child k's state, 0 where the node has no child k."""

    k: Expr
    state: str
    loc: SourceLoc


@dataclass(frozen=True)
class EdgeAll:
    """``edge.name``: a value of the edge to each child (one per child, in the order of ``child.s``)."""

    name: str
    loc: SourceLoc


@dataclass(frozen=True)
class EdgeAt:
    """``edge[k].name``: a value of the edge to child k, 0 where the node has no child k."""

    k: Expr
    name: str
    loc: SourceLoc


@dataclass(frozen=True)
class ParentAll:
    """``parent.s`` (a `down` cell): the parent's state s; on a DAG one per parent, in increasing id order."""

    state: str
    loc: SourceLoc


@dataclass(frozen=True)
class PrevAll:
    """``prev.s`` (a graph cell's node block): the node's own state s one step earlier."""

    state: str
    loc: SourceLoc


Expr = Number | Name | Binary | Neg | Call | Slice | Index | ChildAll | ChildAt | EdgeAll | EdgeAt | ParentAll | PrevAll


@dataclass(frozen=True)
class DimDecl:
    name: str
    value: Number
    loc: SourceLoc


@dataclass(frozen=True)
class InputDecl:
    name: str
    shape: tuple[Expr, ...]  # empty for an index input
    index_range: Expr | None
    loc: SourceLoc
    on_edge: bool = False  # `input w[D] on edge`: one row per edge, read as `edge.w`


@dataclass(frozen=True)
class InitSpec:
    name: str
    args: tuple[float, ...]
    loc: SourceLoc


@dataclass(frozen=True)
class ParamDecl:
    name: str
    shape: tuple[Expr, ...]
    init: InitSpec | None
    loc: SourceLoc


@dataclass(frozen=True)
class StateDecl:
    name: str
    shape: tuple[Expr, ...]
    loc: SourceLoc


@dataclass(frozen=True)
class Target:
    name: str
    loc: SourceLoc


@dataclass(frozen=True)
class Assign:
    targets: tuple[Target, ...]
    values: tuple[Expr, ...]
    loc: SourceLoc  # the `=`


@dataclass(frozen=True)
class Block:
    kind: str  # "leaf", "node", "root" (a down cell's) or "init" (a graph cell's)
    stmts: tuple[Assign, ...]
    loc: SourceLoc


@dataclass(frozen=True)
class OutputDecl:
    name: str
    shape: tuple[Expr, ...]
    at_root: bool
    expr: Expr
    loc: SourceLoc


Item = DimDecl | InputDecl | ParamDecl | StateDecl | Block | OutputDecl


@dataclass(frozen=True)
class CellDef:
    name: str
    structure: str  # "tree" or "dag"
    arity: Number | None
    items: tuple[Item, ...]  # in source order (the checker enforces the order rules)
    loc: SourceLoc
    down: bool = False  # `cell NAME on tree down`: roots first, reading `parent`
    steps: Expr | None = None  # `cell NAME on graph(steps = T)`: T, a constant of numbers and dims


@dataclass(frozen=True)
class Module:
    cells: tuple[CellDef, ...]
    file: str
    source: str
