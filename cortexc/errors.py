"""Typed errors with source locations.

Every failure a user can cause is one of these classes. Errors in a `.cell`
file carry a `SourceLoc` and render as ``file:line:col: error: message``
followed by the source line and a caret, the way C compilers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SourceLoc:
    """A position in a `.cell` source: 1-based line and column."""

    file: str
    line: int
    col: int
    source_line: str = field(default="", repr=False, compare=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"

    def caret(self) -> str:
        """The source line and a caret under the column (tabs kept so it lines up)."""
        if not self.source_line:
            return ""
        prefix = "".join(ch if ch == "\t" else " " for ch in self.source_line[: self.col - 1])
        return f"{self.source_line}\n{prefix}^"


class CortexcError(Exception):
    """Base of every error cortexc raises on purpose."""


class CellError(CortexcError):
    """An error in a `.cell` program, at a location.

    ``others`` holds further errors found in the same run (a checker keeps
    going after the first error so that the user sees them all at once).
    """

    kind = "error"

    def __init__(self, message: str, loc: SourceLoc | None = None):
        super().__init__(message)
        self.message = message
        self.loc = loc
        self.others: list[CellError] = []

    @property
    def all_errors(self) -> list[CellError]:
        return [self, *self.others]

    def format_one(self) -> str:
        if self.loc is None:
            return f"error: {self.message}"
        text = f"{self.loc}: error: {self.message}"
        caret = self.loc.caret()
        return f"{text}\n{caret}" if caret else text

    def format(self) -> str:
        """Every error of this run, each with its caret."""
        return "\n".join(err.format_one() for err in self.all_errors)

    def __str__(self) -> str:
        return self.format()


class CellSyntaxError(CellError):
    """The text is not a `.cell` program (the grammar rejects it)."""


class SourceError(CellError):
    """A `.cell` file cannot be read (missing, unreadable) or is not UTF-8 text."""


class CellTypeError(CellError):
    """The program parses but breaks a rule: unknown name, shape, domain, arity..."""


class DimError(CellError):
    """A `-D NAME=VALUE` override is malformed or names no declared dim."""


class ForestError(CortexcError, ValueError):
    """A forest (or the inputs given for it) cannot be run: says which node or input."""


class InputError(ForestError):
    """Inputs given to a cell do not fit the forest: missing, unknown, wrong shape, dtype or range."""


class OutputError(CortexcError):
    """cortexc cannot write where it must (the cache, a package directory) or read back what it wrote there
    (a damaged package): says where and why."""


class BuildError(CortexcError):
    """Generated code failed to compile; carries the file and the compiler's message."""
