"""A bounded fuzz of the compiler's front door: the examples, mutated (spans cut, doubled, moved; tokens and
odd characters put in). Every result is either a package or a typed error with a place — never another
exception. The quick run tries a few dozen cases; CORTEXC_FUZZ_EXAMPLES raises the count."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortexc.errors import CellError, CortexcError, DimError
from cortexc.frontend.parser import normalize_line_ends
from cortexc.options import KNOWN_TARGETS, CompileOptions
from cortexc.pipeline import compile_package
from tests.helpers import EXAMPLES

SOURCES = [path.read_text(encoding="utf-8") for path in sorted(EXAMPLES.glob("*.cell"))]

#: what a mutation may put in: the language's words and signs, numbers at their edges, and characters that
#: break naive readers (a BOM, CR, form feed, NEL, U+2028, NUL, a surrogate-free astral character)
PIECES = [
    *"(){}[],;:=+-*/@.",
    *("cell", "on", "tree", "dag", "dim", "input", "param", "state", "output", "node", "leaf", "child", "init"),
    *("sum", "mean", "max", "tanh", "sigmoid", "softmax", "concat", "xavier", "uniform", "normal", "at", "root"),
    *("0", "1", "-1", "2.5", "1e30", "1e999", "9" * 60, "9" * 5000, "-" * 400, "tanh(" * 300, "H", "x", "h", "W"),
    *("\ufeff", "\r", "\f", "\x85", "\u2028", "\x00", "\t", "\n", " ", "é", "\U0001f600", "#", "//"),
]


#: the token-aware mutations (which keep the text a cell) weigh more than the blind ones
ACTIONS = ["cut", "double", "insert", "replace", "move", *["number", "nest", "line end"] * 3]
NUMBERS = ["0", "1", "3", "2.5", "1e30", "1e999", "9" * 30, "9" * 5000, "100000000000", "1" + "0" * 400]


@st.composite
def mutated_sources(draw) -> str:
    text = draw(st.sampled_from(SOURCES))
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):  # mostly one: a source that may still parse
        if not text:
            break
        at = draw(st.integers(0, len(text)))
        span = draw(st.integers(0, 40))
        action = draw(st.sampled_from(ACTIONS))
        numbers = list(re.finditer(r"\b[0-9]+(\.[0-9]+)?\b", text))
        names = list(re.finditer(r"\b(x|h|c|b|W|U|child\.h)\b(?!\s*\[)", text))
        if action == "number" and numbers:  # the text stays valid but for the number itself
            match = draw(st.sampled_from(numbers))
            text = text[: match.start()] + draw(st.sampled_from(NUMBERS)) + text[match.end() :]
        elif action == "nest" and names:  # an operand nested deep, by calls or unary minus
            match = draw(st.sampled_from(names))
            depth = draw(st.integers(1, 400))
            head, tail = draw(st.sampled_from([("-" * depth, ""), ("tanh(" * depth, ")" * depth)]))
            text = text[: match.start()] + head + match.group() + tail + text[match.end() :]
        elif action == "line end":  # every line feed made another line end, or one line end put in
            text = text.replace("\n", draw(st.sampled_from(["\r", "\r\n", "\f\n", "\x85\n", "\u2028\n"])))
        elif action == "cut":
            text = text[:at] + text[at + span :]
        elif action == "double":
            text = text[:at] + text[at : at + span] * 2 + text[at + span :]
        elif action == "insert":
            text = text[:at] + draw(st.sampled_from(PIECES)) + text[at:]
        elif action == "replace":
            text = text[:at] + draw(st.sampled_from(PIECES)) + text[at + 1 :]
        else:
            piece = text[at : at + span]
            rest = text[:at] + text[at + span :]
            where = draw(st.integers(0, len(rest)))
            text = rest[:where] + piece + rest[where:]
    return text


def _compiles_or_fails_located(source: str) -> None:
    try:
        package = compile_package(source, "fuzz.cell", CompileOptions.make({}, KNOWN_TARGETS))
    except CortexcError as err:
        if isinstance(err, CellError) and not isinstance(err, DimError):
            assert err.loc is not None and err.loc.file == "fuzz.cell", err.format()
            lines = normalize_line_ends(source).split("\n")  # the lines as the lexer counts them
            assert 1 <= err.loc.line <= len(lines), err.format()
            if err.loc.source_line:  # the echoed line is the one the location names
                assert err.loc.source_line == lines[err.loc.line - 1], err.format()
        return
    assert dict(package.files)["cell.json"]


_FUZZ = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=int(os.environ.get("CORTEXC_FUZZ_EXAMPLES", "40")), **_FUZZ)
@given(source=mutated_sources())
def test_a_mutated_cell_compiles_or_fails_with_a_located_error(source):
    """The quick run (every CI run, `-m "not slow"` too)."""
    _compiles_or_fails_located(source)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("CORTEXC_FUZZ_EXAMPLES", "500")), **_FUZZ)
@given(source=mutated_sources())
def test_many_mutated_cells_compile_or_fail_with_a_located_error(source):
    """The long run (slow: the full suite); before the fixes it found echoed lines that were not the located one."""
    _compiles_or_fails_located(source)


@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in sorted(EXAMPLES.glob("*.cell"))])
def test_the_unmutated_examples_compile(source):
    assert compile_package(source, "example.cell", CompileOptions.make({}, KNOWN_TARGETS)).files
