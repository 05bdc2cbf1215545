"""`cell.json`, the package format: everything a generated package tells the runtime, as frozen dataclasses.

The compiler (`cortexc.codegen.module`) builds a `PackageSpec` and writes `to_json()`; the runtime reads it
back with `PackageSpec.from_json` and every reader uses attributes, so a misspelt field is a mypy error,
not a `KeyError` at run time. Two of these are the compiler's own values too (`PackedWeight` and `Fold`,
which `ir.program` uses), so the package carries what the program holds, with no copy to keep in step.
What differs by target (its kernel file, packed weights, deferred weight gradients, folds, saved
activations, hoisting window, schedule) is in that target's own `TargetSpec`: an executor reads its own
section, never another target's. Facts about the compiled program that the runtime needs are written here
by the compiler, never re-derived from the schedule.

This module imports nothing of the compiler: it is the ground floor that both sides share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cortexc.runtime.abi import LaunchOptions
from cortexc.runtime.signature import CellSignature

#: the format this runtime reads and the compiler writes; a package of another is compiled again
FORMAT_VERSION = 11  # 7: inputs on edges; 8: cells that run down; 9: edge.position families; 10: given_by;
# 11: graph cells (structure steps)


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _strs(values: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


@dataclass(frozen=True)
class PackedWeight:
    """A GEMM weight: params as one block matrix, packed once at load time
    for the GEMM micro-kernel. `blocks` block rows stacked by rows, each of ``blocks[i]`` params side by side
    (the next ones of `params`, in order), each transposed where `transposed` says (backward products
    ``W^T @ g``). The products of one GEMM group each make a block row: ``P @ v`` one of one param, the
    direct node kernel's ``[P_1 | P_2] @ concat(a, b)`` (`passes.direct`) one of several; two such sums over
    the same vectors share one operand and so one weight ``[[P_1 | P_2]; [Q_1 | Q_2]]``."""

    name: str
    params: tuple[str, ...]
    m: int
    k: int
    transposed: tuple[bool, ...]
    blocks: tuple[int, ...]

    def block_rows(self) -> list[list[tuple[str, bool]]]:
        """The (param, transposed) pairs of each block row, left to right."""
        rows, start = [], 0
        for count in self.blocks:
            rows.append(list(zip(self.params[start : start + count], self.transposed[start : start + count])))
            start += count
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": list(self.params),
            "m": self.m,
            "k": self.k,
            "transposed": list(self.transposed),
            "blocks": list(self.blocks),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PackedWeight:
        transposed = tuple(bool(t) for t in data["transposed"])
        return cls(
            str(data["name"]), _strs(data["params"]), int(data["m"]), int(data["k"]), transposed, _ints(data["blocks"])
        )


@dataclass(frozen=True)
class DeferredSpec:
    """A weight-gradient term whose factor rows a backward keeps (`DeferredOuter`): one row of m + k floats
    per node position (`rows` "node") or per child edge ("child"); `narrow`: kept only by small launches."""

    param: str
    rows: str
    m: int
    k: int
    narrow: bool

    def to_json(self) -> dict[str, Any]:
        return {"param": self.param, "rows": self.rows, "m": self.m, "k": self.k, "narrow": self.narrow}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeferredSpec:
        return cls(str(data["param"]), str(data["rows"]), int(data["m"]), int(data["k"]), bool(data["narrow"]))


@dataclass(frozen=True)
class Fold:
    """A GEMM of a table row folded into a table (`cortexc.passes.fold`):
    ``E[idx] @ concat(weights)^T`` depends on the row only, so with the params fixed the product is row
    ``idx`` of `E @ W^T` (`rows` x `m`), computed once by the package's own `cx_fold` with packed weight
    `packed`, over every row of `table`."""

    name: str  # by which `Gemm.fold` names it; its index in `Program.folds` is its slot in `cx_call.folded`
    packed: str  # the packed weight of the GEMMs it replaces
    table: str  # the param looked up (E); each GEMM reads the row its own index input chooses
    rows: int  # V: rows of the table
    m: int  # columns of the folded table (the GEMM's m)
    k: int  # columns of E

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "packed": self.packed,
            "table": self.table,
            "rows": self.rows,
            "m": self.m,
            "k": self.k,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fold:
        return cls(
            str(data["name"]),
            str(data["packed"]),
            str(data["table"]),
            int(data["rows"]),
            int(data["m"]),
            int(data["k"]),
        )


@dataclass(frozen=True)
class SavedSpec:
    """An array a training forward keeps for its backward (`passes.saving`): a row of `width` floats per
    internal node (`internal`) or per leaf."""

    name: str
    width: int
    internal: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "width": self.width, "rows": "internal" if self.internal else "leaves"}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SavedSpec:
        rows = str(data["rows"])
        if rows not in ("internal", "leaves"):
            raise ValueError(f"saved rows {rows!r}")
        return cls(str(data["name"]), int(data["width"]), rows == "internal")


@dataclass(frozen=True)
class TargetSpec:
    """One target's section: its kernel file and what its executor needs to know of its program."""

    kernel_file: str
    kernel_sha256: str
    packed: tuple[PackedWeight, ...]  # in the order the kernels index `cx_call.packed`
    deferred: tuple[DeferredSpec, ...]  # in the order of `cx_call.deferred`
    folds: tuple[Fold, ...]  # in the order of `cx_call.folded`
    saved: tuple[SavedSpec, ...]  # in the order of `cx_call.saved`
    hoisted_window_rows: int  # an inference hoists a window of this many rows at a time (0: all at once)
    training_window: bool  # a training forward may too (its backward then reads no hoisted row)
    hoisted_gradients_set: tuple[bool, ...]  # per hoisted array: the backward sets every row of its gradient
    schedule: tuple[Mapping[str, Any], ...]  # the kernels' steps, for people and tools (the runtime reads none)

    def to_json(self) -> dict[str, Any]:
        return {
            "kernel_file": self.kernel_file,
            "kernel_sha256": self.kernel_sha256,
            "packed": [w.to_json() for w in self.packed],
            "deferred": [t.to_json() for t in self.deferred],
            "folds": [f.to_json() for f in self.folds],
            "saved": [s.to_json() for s in self.saved],
            "hoisted_window_rows": self.hoisted_window_rows,
            "training_window": self.training_window,
            "hoisted_gradients_set": list(self.hoisted_gradients_set),
            "schedule": [dict(k) for k in self.schedule],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TargetSpec:
        return cls(
            kernel_file=str(data["kernel_file"]),
            kernel_sha256=str(data["kernel_sha256"]),
            packed=tuple(PackedWeight.from_json(w) for w in data["packed"]),
            deferred=tuple(DeferredSpec.from_json(t) for t in data["deferred"]),
            folds=tuple(Fold.from_json(f) for f in data["folds"]),
            saved=tuple(SavedSpec.from_json(s) for s in data["saved"]),
            hoisted_window_rows=int(data["hoisted_window_rows"]),
            training_window=bool(data["training_window"]),
            hoisted_gradients_set=tuple(bool(s) for s in data["hoisted_gradients_set"]),
            schedule=tuple(dict(k) for k in data["schedule"]),
        )


@dataclass(frozen=True)
class AbiSpec:
    """The order of each per-cell pointer array of `cx_call` (the packed weights' and saved arrays' orders
    are their target's: `TargetSpec`)."""

    params: tuple[str, ...]
    inputs: tuple[str, ...]
    states: tuple[str, ...]
    hoisted: tuple[str, ...]
    outputs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {name: list(getattr(self, name)) for name in ("params", "inputs", "states", "hoisted", "outputs")}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AbiSpec:
        return cls(*(_strs(data[name]) for name in ("params", "inputs", "states", "hoisted", "outputs")))


@dataclass(frozen=True)
class CellSpec:
    """One cell of a package: its signature, kernel ABI and the sections of the targets it was built for."""

    signature: CellSignature
    abi: AbiSpec
    hoisted_widths: tuple[int, ...]  # per hoisted array (the ABI's order): floats per row
    dropout_sites: int  # 0: training mode changes nothing (cortexc.torch then draws no seed)
    launch: LaunchOptions  # the CUDA launch the package asks for by default
    targets: Mapping[str, TargetSpec]

    @property
    def name(self) -> str:
        return self.signature.name

    def target(self, name: str) -> TargetSpec:
        """The section of target `name` (a `KeyError` if the package was built without it)."""
        return self.targets[name]

    def to_json(self) -> dict[str, Any]:
        return {
            "signature": self.signature.to_json(),
            "abi": self.abi.to_json(),
            "hoisted_widths": list(self.hoisted_widths),
            "dropout_sites": self.dropout_sites,
            "launch": self.launch.to_json(),
            "targets": {name: section.to_json() for name, section in self.targets.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CellSpec:
        return cls(
            signature=CellSignature.from_json(dict(data["signature"])),
            abi=AbiSpec.from_json(data["abi"]),
            hoisted_widths=_ints(data["hoisted_widths"]),
            dropout_sites=int(data["dropout_sites"]),
            launch=LaunchOptions.from_json(data["launch"]),
            targets={str(name): TargetSpec.from_json(section) for name, section in data["targets"].items()},
        )


@dataclass(frozen=True)
class PackageSpec:
    """A whole `cell.json`: the package, the `.cell` source it came from (only `device="interp"` compiles it
    again), the `-D` values, the targets built and every cell."""

    cortexc: str  # the compiler's version
    package: str
    source_file: str
    source: str
    defines: Mapping[str, int]
    targets: tuple[str, ...]
    cells: tuple[CellSpec, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "cortexc": self.cortexc,
            "package": self.package,
            "source_file": self.source_file,
            "source": self.source,
            "defines": dict(self.defines),
            "targets": list(self.targets),
            "cells": [cell.to_json() for cell in self.cells],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PackageSpec:
        """The package `data` describes; a `FormatError` for another format, `KeyError`/`ValueError`/
        `TypeError` where it is damaged (the loader words both)."""
        if data.get("format") != FORMAT_VERSION:
            raise FormatError(data.get("format"))
        return cls(
            cortexc=str(data["cortexc"]),
            package=str(data["package"]),
            source_file=str(data["source_file"]),
            source=str(data["source"]),
            defines={str(k): int(v) for k, v in data["defines"].items()},
            targets=_strs(data["targets"]),
            cells=tuple(CellSpec.from_json(cell) for cell in data["cells"]),
        )


class FormatError(ValueError):
    """A `cell.json` of another format than `FORMAT_VERSION` (an older or newer cortexc wrote it)."""

    def __init__(self, found: object):
        super().__init__(f"format {found!r}")
        self.found = found


__all__ = [
    "FORMAT_VERSION",
    "AbiSpec",
    "CellSpec",
    "DeferredSpec",
    "Fold",
    "FormatError",
    "PackageSpec",
    "PackedWeight",
    "SavedSpec",
    "TargetSpec",
]
