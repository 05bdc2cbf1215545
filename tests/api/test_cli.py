"""The command line: summaries, IR dumps, and exit status 1 with a located message on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cortexc.cli import main
from tests.helpers import EXAMPLES, REPO, sst_path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cortexc.cli", *args], capture_output=True, text=True)


def test_check_prints_a_summary(capsys):
    assert main(["check", str(EXAMPLES / "binary_treelstm.cell")]) == 0
    out = capsys.readouterr().out
    assert "cell BinaryTreeLSTM on tree(arity = 2)" in out
    assert "V = 21701, X = 300, H = 150, C = 5" in out
    assert "E[21701, 300]" in out and "6,510,300" in out and "normal(0.0, 0.1)" in out
    assert "total" in out and "6,871,805" in out
    assert "word : index[21701]" in out
    assert "states   h[150], c[150]" in out
    assert "outputs  logits[5]" in out


def test_check_with_defines_changes_shapes(capsys):
    assert main(["check", str(EXAMPLES / "treelstm.cell"), "-D", "H=256", "-D", "X=64"]) == 0
    out = capsys.readouterr().out
    assert "W_iou[768, 64]" in out and "U_f[256, 256]" in out


def test_dump_ir_writes_every_stage(tmp_path):
    assert main(["check", str(EXAMPLES / "lstm.cell"), "--dump-ir", str(tmp_path)]) == 0
    dumped = sorted(p.name for p in tmp_path.iterdir())
    assert dumped and dumped[0] == "LSTM.00-lower.ir"
    assert "cell LSTM on tree(arity = 1)" in (tmp_path / dumped[0]).read_text()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("cell A on tree { state h[2] node { h = x } }", "t.cell:1:40: error: unknown name 'x'"),
        ("cell A on tree { state h[2] node { h = } }", "t.cell:1:40: error: unexpected '}'"),
    ],
)
def test_check_reports_errors_with_exit_1_and_no_traceback(tmp_path, text, expected):
    path = tmp_path / "t.cell"
    path.write_text(text + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "cortexc.cli", "check", "t.cell"], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 1
    assert result.stderr.startswith(expected), result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[1] == text
    column = int(expected.split(":")[2])
    assert lines[2] == " " * (column - 1) + "^"


def test_unknown_define_is_an_error():
    result = run_cli("check", str(EXAMPLES / "treelstm.cell"), "-D", "Q=3")
    assert result.returncode == 1
    assert "no cell in" in result.stderr and "'Q'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("define", ["H", "H=", "H=-3", "H=0", "H=abc", "=4"])
def test_malformed_define_is_an_error(define):
    result = run_cli("check", str(EXAMPLES / "treelstm.cell"), "-D", define)
    assert result.returncode == 1
    assert "expected NAME=VALUE" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_file_is_an_error():
    result = run_cli("check", "no/such/file.cell")
    assert result.returncode == 1
    assert "No such file" in result.stderr and "Traceback" not in result.stderr


def test_run_compares_compiled_and_eager_on_the_builtin_forest(capsys):
    assert main(["run", str(EXAMPLES / "treernn.cell"), "--limit", "5", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "TreeRNN on built-in random forest: 5 trees" in out
    assert "compiled (cpu)" in out and "eager (interp)" in out and "speed-up" in out
    error = float(out.split("max |compiled - eager| / max |eager| = ")[1].split()[0])
    assert error < 1e-5


@pytest.mark.slow
def test_run_on_sst_trees(capsys):
    trees = sst_path("dev")
    assert (
        main(
            [
                "run",
                str(EXAMPLES / "binary_treelstm.cell"),
                "-D",
                "H=16",
                "-D",
                "X=8",
                "--trees",
                str(trees),
                "--limit",
                "12",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "BinaryTreeLSTM on" in out and ": 12 trees" in out


def test_run_rejects_a_forest_the_cell_cannot_take(tmp_path):
    trees = tmp_path / "t.txt"
    trees.write_text("(1 (2 a) (3 b) (4 c))\n")  # three children, arity 2
    result = run_cli("run", str(EXAMPLES / "treernn.cell"), "--trees", str(trees))
    assert result.returncode == 1
    assert "3 children" in result.stderr and "Traceback" not in result.stderr


def test_check_describes_the_blocks_as_written(capsys):
    assert main(["check", str(EXAMPLES / "treelstm.cell")]) == 0
    assert "blocks   node (leaves run it with no children)" in capsys.readouterr().out
    assert main(["check", str(EXAMPLES / "treernn.cell")]) == 0
    assert "blocks   leaf, node" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bad arguments, one line each


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "CELL", "--limit", "-5"], "argument --limit: expected a positive integer, got '-5'"),
        (["run", "CELL", "--limit", "0"], "argument --limit: expected a positive integer, got '0'"),
        (["run", "CELL", "--repeats", "0"], "argument --repeats: expected a positive integer, got '0'"),
        (["run", "CELL", "--seed", "-1"], "argument --seed: expected a non-negative integer, got '-1'"),
    ],
)
def test_bad_counts_are_usage_errors(argv, message, capsys):
    argv = [str(EXAMPLES / "treernn.cell") if a == "CELL" else a for a in argv]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    import cortexc.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_check", interrupted)
    assert main(["check", str(EXAMPLES / "treernn.cell")]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_errors_at_run_time_have_the_error_prefix_and_name_the_trees_file(tmp_path, capsys):
    trees = tmp_path / "bad.ptb"
    trees.write_text("(1 (2 a) (3 b)\n", encoding="utf-8")
    assert main(["run", str(EXAMPLES / "treernn.cell"), "--trees", str(trees)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {trees}: line 1") and err.count("\n") == 1
    trees.write_bytes(b"(1 caf\xe9)\n")
    assert main(["run", str(EXAMPLES / "treernn.cell"), "--trees", str(trees)]) == 1
    assert capsys.readouterr().err == f"error: {trees}: line 1 is not UTF-8 text (byte 0xe9 at offset 6)\n"


def test_out_naming_a_file_says_so(tmp_path, capsys):
    out = tmp_path / "a_file"
    out.write_text("", encoding="utf-8")
    assert main(["compile", str(EXAMPLES / "treernn.cell"), "-o", str(out)]) == 1
    assert capsys.readouterr().err == f"error: -o {out}: that is a file; the package goes into a directory\n"


def test_version_and_python_dash_m():
    import cortexc

    for command in ([sys.executable, "-m", "cortexc", "--version"], [sys.executable, "-m", "cortexc.cli", "--version"]):
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0 and result.stdout == f"cortexc {cortexc.__version__}\n", result.stderr


def test_run_runs_the_interpreter_once_or_not_at_all(monkeypatch, capsys):
    from cortexc import reference

    calls = []
    real = reference.run_linearized
    monkeypatch.setattr(reference, "run_linearized", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert main(["run", str(EXAMPLES / "treernn.cell"), "--limit", "3", "--repeats", "1"]) == 0
    assert len(calls) == 1 and "eager (interp)" in capsys.readouterr().out
    assert main(["run", str(EXAMPLES / "treernn.cell"), "--limit", "3", "--repeats", "1", "--no-eager"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 1 and "compiled (cpu)" in out and "eager" not in out


def test_dump_ir_says_what_it_wrote_and_help_shows_defaults(tmp_path, capsys):
    dump = tmp_path / "ir"
    assert main(["check", str(EXAMPLES / "treernn.cell"), "--dump-ir", str(dump)]) == 0
    count = len([p for p in dump.iterdir()])
    assert f"wrote {count} IR and program dumps to {dump}/" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: 5)" in text and "(default: 0)" in text
    # defaults are shown where they say something: not argparse's "None", a flag's "True", "[]" or twice
    assert "(default: None)" not in text and "(default: True)" not in text and "(default: [])" not in text
    assert "(default: the first) (default" not in text


def test_run_shows_the_interpreters_progress_without_tqdm(monkeypatch, capsys):
    """tqdm is optional: without it a plain line on stderr counts the nodes walked, up to all of them."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` raises ImportError
    assert main(["run", str(EXAMPLES / "treernn.cell"), "--limit", "40", "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    nodes = int(captured.out.split(" nodes, ")[0].rsplit(" ", 1)[1])
    assert nodes > 256  # more than one progress step
    assert captured.err.startswith(f"interpreter: 100% {nodes:,}/{nodes:,} nodes [")
    assert "eager (interp)" in captured.out


def test_run_shows_the_interpreters_progress_with_tqdm(monkeypatch, capsys):
    tqdm = pytest.importorskip("tqdm")
    updates = []
    real = tqdm.tqdm.update
    monkeypatch.setattr(tqdm.tqdm, "update", lambda self, n=1: updates.append(n) or real(self, n))
    assert main(["run", str(EXAMPLES / "treernn.cell"), "--limit", "40", "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    nodes = int(captured.out.split(" nodes, ")[0].rsplit(" ", 1)[1])
    assert sum(updates) == nodes and len(updates) == -(-nodes // 256)
    assert "interpreter: 100%" in captured.err


def test_a_closed_pipe_ends_the_program_quietly():
    """`cortexc check FILE | head -1`: the reader has gone before the summary is written; no `error:` line,
    no traceback, the status a tool ended by SIGPIPE has (128 + 13)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "cortexc.cli", "check", str(EXAMPLES / "treelstm.cell")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # long before the interpreter has started
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141, stderr
    assert stderr == ""


def test_a_define_too_long_to_print_is_a_dim_error():
    """Python refuses to read or write ints of over 4300 digits: a message, not a ValueError."""
    result = run_cli("check", str(EXAMPLES / "treelstm.cell"), "-D", "H=" + "9" * 6000)
    assert result.returncode == 1
    assert "a dim must be at most 16777216" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr) < 300


def test_a_file_of_comments_echoes_its_first_line_with_a_caret(tmp_path):
    path = tmp_path / "comments.cell"
    path.write_text("# only comments\n# here\n", encoding="utf-8")
    result = run_cli("check", str(path))
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"{path}:1:1: error: the file defines no cell")
    assert lines[1:] == ["# only comments", "^"]


def test_a_cuda_package_builds_alone(tmp_path):
    """`cortexc compile --target cuda -o OUT`: the `.cu` includes only system headers (the prelude of
    cortexc's macros is inlined), so a build system given OUT alone compiles it."""
    assert main(["compile", str(EXAMPLES / "lstm.cell"), "--target", "cuda", "-o", str(tmp_path)]) == 0
    (source,) = (tmp_path / "lstm").glob("*.cu")
    includes = [line for line in source.read_text().splitlines() if line.startswith("#include")]
    assert includes and all(line.split()[1].startswith("<") for line in includes), includes
    assert "#define CX_NVCC_PRELUDE" in source.read_text()
