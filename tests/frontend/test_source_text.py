"""How the front end reads a file: encodings, line ends, numbers and dims at their limits — each bad input a
typed error at its place (the CLI: exit 1, one message, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cortexc
from cortexc.cli import main, parse_defines
from cortexc.errors import CellSyntaxError, CellTypeError, DimError, SourceError
from cortexc.frontend.parser import parse
from cortexc.options import MAX_DIM
from cortexc.pipeline import compile_source
from tests.helpers import REPO

GOOD = "cell C on tree {\n    dim H = 4\n    input x[H]\n    state h[H]\n    node { h = tanh(x) }\n}\n"
BAD_LINE_5 = "cell C on tree {\n    dim H = 4\n    input x[H]\n    state h[H]\n    node { h = nope(x) }\n}\n"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cortexc.cli", *args], capture_output=True, text=True, cwd=REPO)


def test_a_file_that_is_not_utf8_is_a_located_source_error(tmp_path):
    path = tmp_path / "latin1.cell"
    path.write_bytes(GOOD.replace("tanh(x)", "tanh(x) # caf\xe9").encode("latin-1"))
    with pytest.raises(SourceError, match=r"not UTF-8 text \(byte 0xe9\)") as info:
        cortexc.load(path, out_dir=tmp_path / "out")
    assert (info.value.loc.line, info.value.loc.col) == (5, 29)
    result = _cli("check", str(path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{path}:5:29: error: the file is not UTF-8 text" in result.stderr


def test_a_missing_file_is_a_source_error_naming_it(tmp_path):
    path = tmp_path / "absent.cell"
    with pytest.raises(SourceError, match="cannot read .*absent.cell: No such file"):
        cortexc.load(path)
    result = _cli("compile", str(path), "-o", str(tmp_path / "out"))
    assert result.returncode == 1 and "Traceback" not in result.stderr and "absent.cell" in result.stderr


def test_a_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.cell"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert [c.name for c in cortexc.compile_file(path)] == ["C"]
    assert [c.name for c in compile_source("\ufeff" + GOOD, "bom.cell")] == ["C"]


@pytest.mark.parametrize(
    "line_end, extra",
    [("\r", ""), ("\r\n", ""), ("\n", "\f"), ("\n", "\x85"), ("\n", "\u2028"), ("\n", "\x1c")],
    ids=["CR", "CRLF", "form feed", "NEL", "line separator", "file separator"],
)
def test_the_echoed_line_is_the_line_the_location_names(line_end, extra):
    """`str.splitlines` splits at form feeds, NEL and U+2028 too; the lexer counts only line feeds."""
    lines = BAD_LINE_5.split("\n")
    lines[1] += extra * (extra == "\f")  # a form feed is whitespace to the lexer; the others are errors
    text = line_end.join(lines)
    with pytest.raises(CellTypeError) as info:
        compile_source(text, "t.cell")
    loc = info.value.loc
    assert (loc.line, loc.col) == (5, 16) and loc.source_line == "    node { h = nope(x) }"
    if extra and extra != "\f":
        with pytest.raises(CellSyntaxError) as info:
            parse(GOOD.replace("state h[H]", f"state {extra}h[H]"), "t.cell")
        loc = info.value.loc
        assert loc.line == 4 and loc.source_line == f"    state {extra}h[H]"


def test_a_number_with_thousands_of_digits_is_a_syntax_error():
    with pytest.raises(CellSyntaxError, match="has 5000 characters") as info:
        compile_source(GOOD.replace("dim H = 4", "dim H = " + "9" * 5000), "t.cell")
    assert (info.value.loc.line, info.value.loc.col) == (2, 13)


@pytest.mark.parametrize("value", ["²", "٣", "1e3", "0x10", str(10**30)])
def test_a_define_takes_ascii_digits_only_and_a_bounded_dim(value, tmp_path):
    path = tmp_path / "c.cell"
    path.write_text(GOOD, encoding="utf-8")
    with pytest.raises(DimError):
        defines = parse_defines([f"H={value}"])
        compile_source(GOOD, "t.cell", defines)
    assert main(["check", str(path), "-D", f"H={value}"]) == 1


def test_dims_and_sizes_have_an_upper_bound(tmp_path):
    with pytest.raises(DimError, match="at most"):
        compile_source(GOOD, "t.cell", {"H": 10**12})
    with pytest.raises(CellTypeError, match="too large") as info:
        compile_source(GOOD.replace("dim H = 4", "dim H = 1000000000000"), "t.cell")
    assert info.value.loc.line == 2
    huge = GOOD.replace("input x[H]", "input x[H]\n    param W[H, H]").replace("dim H = 4", f"dim H = {MAX_DIM}")
    with pytest.raises(CellTypeError, match="param W would have .* elements") as info:
        compile_source(huge, "t.cell")
    assert info.value.loc.line == 4


@pytest.mark.parametrize("init", ["uniform(0, 1e999)", "normal(0, 1e999)", "uniform(-1e38, 1e38)", "normal(1e35, 1)"])
def test_init_numbers_must_keep_params_finite(init):
    text = GOOD.replace("input x[H]", f"input x[H]\n    param b[H] init {init}")
    with pytest.raises(CellTypeError, match="at most 1e\\+30 in magnitude") as info:
        compile_source(text, "t.cell")
    assert info.value.loc.line == 4


def test_load_with_a_defines_dict_says_dims_are_keywords(tmp_path):
    """`cortexc.load(path, defines={...})` (the CLI's -D spelt as a keyword) says how to write it."""
    import cortexc

    path = tmp_path / "c.cell"
    path.write_text(GOOD, encoding="utf-8")
    with pytest.raises(DimError, match=r"write cortexc.load\(path, H=8\), not defines="):
        cortexc.load(path, out_dir=tmp_path / "out", defines={"H": 8})
    assert not (tmp_path / "out").exists()
