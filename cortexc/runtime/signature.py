"""A compiled cell's signature: what the runtime needs to know about it, and nothing more.

The compiler writes it into the package's `cell.json`; the runtime reads it
back to validate forests and inputs, initialise params, size the result
arrays and fill the kernel ABI, so that running a package never needs the
front end or the IR. Frozen dataclasses, read from and written to plain JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cortexc.errors import CortexcError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class StructureSig:
    """The kind of structure a cell runs on and the properties the runtime checks a forest against."""

    kind: str  # "tree", "dag" or "graph": the name written in the `.cell` file
    shares_children: bool  # a node may have several parents (a DAG)
    arity: int | None  # exact number of child slots (`tree(arity = 2)`), None for any
    down: bool = False  # a `down` cell: run on the reversed forest (`runtime.topdown`), roots first
    steps: int = 0  # a graph cell's T (`on graph(steps = T)`): run on its T + 1 unrolled steps (`runtime.graph`)


@dataclass(frozen=True)
class InitSig:
    kind: str  # zeros, ones, xavier, uniform, normal
    args: tuple[float, ...] = ()

    def __str__(self) -> str:
        if not self.args:
            return self.kind
        return f"{self.kind}({', '.join(repr(a) for a in self.args)})"


@dataclass(frozen=True)
class ParamSig:
    name: str
    shape: Shape
    init: InitSig

    @property
    def size(self) -> int:
        return math.prod(self.shape)


#: the edge inputs the runtime gives a `down` cell (`runtime.edges`), by what they hold: the edge to a node's
#: parent's `edge.position` and `edge.siblings` (names no `.cell` file may declare)
GIVEN_INPUTS = {"position": "_edge_position", "siblings": "_edge_siblings"}


@dataclass(frozen=True)
class InputSig:
    """An input: float32 rows of `shape`, or (``index_range`` set) one int32 in [0, range); one row per node,
    or with ``on_edge`` one per edge (`Forest.edge_ptr`'s order)."""

    name: str
    shape: Shape
    index_range: int | None = None
    on_edge: bool = False
    given_by: str = ""  # "": the caller's; "position" / "siblings": given by the runtime (`runtime.edges`)

    @property
    def is_index(self) -> bool:
        return self.index_range is not None


@dataclass(frozen=True)
class StateSig:
    name: str
    shape: Shape


@dataclass(frozen=True)
class OutputSig:
    name: str
    shape: Shape
    at_root: bool


@dataclass(frozen=True)
class EmbeddingSig:
    """A param used only as a look-up table (`E[word]`), by one index input that indexes nothing else.

    `rows` names the nodes that look it up ("leaves", "internal", "all" or "roots"); a sparse gradient
    (`cortexc.torch` with ``sparse=True``, the native optimizers) holds the rows those nodes read.
    """

    param: str
    index: str
    rows: tuple[str, ...]


@dataclass(frozen=True)
class CellSignature:
    name: str
    structure: StructureSig
    dims: tuple[tuple[str, int], ...]
    params: tuple[ParamSig, ...]
    inputs: tuple[InputSig, ...]
    states: tuple[StateSig, ...]
    outputs: tuple[OutputSig, ...]
    embeddings: tuple[EmbeddingSig, ...] = ()
    #: (family, its number of matrices) for each `W[edge.position] @ v`: a node may have that many children
    positions: tuple[tuple[str, int], ...] = ()

    def embedding(self, param: str) -> EmbeddingSig | None:
        """The look-up of `param` if it is used only as an embedding table, else None."""
        return next((e for e in self.embeddings if e.param == param), None)

    @property
    def arity(self) -> int | None:
        return self.structure.arity

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "structure": {
                "kind": self.structure.kind,
                "shares_children": self.structure.shares_children,
                "arity": self.structure.arity,
                "down": self.structure.down,
                "steps": self.structure.steps,
            },
            "dims": dict(self.dims),
            "params": [
                {"name": p.name, "shape": list(p.shape), "init": {"kind": p.init.kind, "args": list(p.init.args)}}
                for p in self.params
            ],
            "inputs": [
                {
                    "name": i.name,
                    "shape": list(i.shape),
                    "index_range": i.index_range,
                    "on_edge": i.on_edge,
                    "given_by": i.given_by,
                }
                for i in self.inputs
            ],
            "states": [{"name": s.name, "shape": list(s.shape)} for s in self.states],
            "outputs": [{"name": o.name, "shape": list(o.shape), "at_root": o.at_root} for o in self.outputs],
            "embeddings": [{"param": e.param, "index": e.index, "rows": list(e.rows)} for e in self.embeddings],
            "positions": [[family, count] for family, count in self.positions],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CellSignature:
        """The signature of a `cell.json` entry (a `CortexcError` naming the field if it is malformed)."""
        try:
            structure = data["structure"]
            return cls(
                name=str(data["name"]),
                structure=StructureSig(
                    str(structure["kind"]),
                    bool(structure["shares_children"]),
                    _opt_int(structure["arity"]),
                    bool(structure["down"]),
                    int(structure["steps"]),
                ),
                dims=tuple((str(k), int(v)) for k, v in data["dims"].items()),
                params=tuple(
                    ParamSig(
                        str(p["name"]),
                        _shape(p["shape"]),
                        InitSig(str(p["init"]["kind"]), tuple(float(a) for a in p["init"]["args"])),
                    )
                    for p in data["params"]
                ),
                inputs=tuple(
                    InputSig(
                        str(i["name"]),
                        _shape(i["shape"]),
                        _opt_int(i["index_range"]),
                        bool(i["on_edge"]),
                        str(i["given_by"]),
                    )
                    for i in data["inputs"]
                ),
                states=tuple(StateSig(str(s["name"]), _shape(s["shape"])) for s in data["states"]),
                outputs=tuple(
                    OutputSig(str(o["name"]), _shape(o["shape"]), bool(o["at_root"])) for o in data["outputs"]
                ),
                embeddings=tuple(
                    EmbeddingSig(str(e["param"]), str(e["index"]), tuple(str(r) for r in e["rows"]))
                    for e in data.get("embeddings", ())
                ),
                positions=tuple((str(family), int(count)) for family, count in data["positions"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CortexcError(f"a cell signature in cell.json is malformed ({type(err).__name__}: {err})") from None


def _shape(items: Any) -> Shape:
    return tuple(int(d) for d in items)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
