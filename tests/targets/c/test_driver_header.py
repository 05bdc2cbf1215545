"""The C driver's rules (cortexc/targets/c/templates/cx_driver.h) as C: the header compiles alone, every
rendered C driver carries it verbatim (so the package's one source file, the build key and the export hold
it), and tests/c/driver_header_test.c checks what its comments promise: the tiles of a launch depend on the
row count only, the chunked sums and the staged rows add in one order whatever the team (1-4 threads,
bitwise), and the windows, aligned levels, owned columns and sharing thresholds."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from cortexc.codegen.render import environment
from cortexc.options import CompileOptions
from cortexc.pipeline import Source, run_stages
from cortexc.targets.c.target import TARGET as C
from tests.helpers import EXAMPLES, REPO

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found (needed to compile the header)")

TEMPLATES = REPO / "cortexc" / "targets" / "c" / "templates"
HEADER = TEMPLATES / "cx_driver.h"
TESTS = REPO / "tests" / "c" / "driver_header_test.c"
CHECKS = ("tiles", "team_tiles", "dispatch", "chunks", "scatter", "aligned", "windows", "columns", "sharing")
STRICT = ("-std=c11", "-Wall", "-Wextra", "-Werror")


def test_the_header_compiles_alone(tmp_path):
    """As C11 with OpenMP, and without it (the header's fallbacks; the pragmas then mean nothing)."""
    for flags in (("-fopenmp",), ("-Wno-unknown-pragmas",)):
        done = subprocess.run(
            ["gcc", *STRICT, *flags, "-x", "c", "-c", str(HEADER), "-o", str(tmp_path / "alone.o")],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr


def test_the_rendered_driver_carries_the_header_verbatim():
    """No template text in it (Jinja renders it as it is), and the C of a cell holds it once: what gcc builds,
    the build key (runtime/build.py: a digest of the source) and `cortexc export` all see the header."""
    text = HEADER.read_text()
    assert environment().get_template("c/cx_driver.h").render() == text
    path = EXAMPLES / "lstm.cell"
    rendered = run_stages(Source(path.read_text(), str(path)), CompileOptions.make(targets=("c",)), until="render")
    source = dict(rendered[0].sources)["c"]
    assert source.count(text) == 1


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """The test program, built at the C target's tile size without -ffast-math (its reference sums are
    written in the order they must have)."""
    program = tmp_path_factory.mktemp("driver") / "driver_header_test"
    command = ["gcc", *STRICT, "-O2", "-fopenmp", f"-DCX_TILE={C.tile_rows}", f"-I{TEMPLATES}", str(TESTS)]
    done = subprocess.run([*command, "-o", str(program)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return program


@pytest.mark.parametrize("check", CHECKS)
def test_driver_rules(checks, check):
    """One check of the program; its teams are exactly the threads it asks for (OMP_DYNAMIC off)."""
    env = dict(os.environ, OMP_DYNAMIC="false")
    env.pop("OMP_THREAD_LIMIT", None)
    done = subprocess.run([str(checks), check], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{check}: ok"
