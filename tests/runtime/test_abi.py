"""The kernel ABI is defined once (cortexc/runtime/abi.py): the C typedefs the code generator renders and the
ctypes structures the executors fill must agree member for member, offset for offset; and the generated code
reads its launch options and the nvcc prelude from the one place each lives."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from cortexc.codegen.render import render
from cortexc.errors import CortexcError
from cortexc.passes.columns import split_columns
from cortexc.passes.deferred import defer_outer_products
from cortexc.passes.schedule import schedule
from cortexc.pipeline import compile_file
from cortexc.runtime import abi
from cortexc.runtime.abi import LaunchMode, LaunchOptions
from cortexc.runtime.package import PackageSpec
from cortexc.targets.cuda.target import TARGET as CUDA
from tests.helpers import EXAMPLES, REPO

STRUCTS = {"cx_call": abi.CxCall, "cx_grad": abi.CxGrad, "cx_launch": abi.CxLaunch}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found")
def test_rendered_typedefs_and_ctypes_structs_have_one_layout(tmp_path):
    """A C program prints offsetof of every member and sizeof of every struct, compiled from the very typedefs
    the templates render; the ctypes structures must say the same."""
    lines = ["#include <stddef.h>", "#include <stdint.h>", "#include <stdio.h>"]
    lines += [abi.c_typedef(name, fields) for name, fields in abi.STRUCTS.items()]
    lines.append("int main(void) {")
    expected = []
    for name, fields in abi.STRUCTS.items():
        for field in fields:
            lines.append(f'    printf("%zu\\n", offsetof({name}, {field.name}));')
            expected.append(getattr(STRUCTS[name], field.name).offset)
        lines.append(f'    printf("%zu\\n", sizeof({name}));')
        expected.append(ctypes.sizeof(STRUCTS[name]))
    lines.append("    return 0;\n}")
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines))
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", "-o", tmp_path / "layout", source], check=True)
    printed = subprocess.run([tmp_path / "layout"], capture_output=True, text=True, check=True).stdout.split()
    assert [int(x) for x in printed] == expected


def test_generated_code_declares_the_abi_it_is_given():
    """The rendered source carries the typedefs of abi.py verbatim (C target: cx_call and cx_grad; CUDA: also
    cx_launch), the one nvcc prelude inline (it includes no header of cortexc's) and never reads the
    environment."""
    program = defer_outer_products(split_columns(schedule(compile_file(EXAMPLES / "binary_treelstm.cell")[0])))
    source = render(program, CUDA, "binary_treelstm.cell")
    for name, fields in abi.STRUCTS.items():
        assert abi.c_typedef(name, fields) in source, name
    prelude = (REPO / "cortexc" / "targets" / "cuda" / "cuda_prelude.cuh").read_text().rstrip()
    assert source.count(prelude) == 1 and '#include "' not in source
    cuda = source.replace(prelude, "")
    for name in abi.DEVICE_MEMORY_EXPORTS:  # what DeviceMemory checks a library for
        assert f'extern "C" int {name}(' in cuda, name
    # every launch and synchronisation of the entry points names the call's stream
    assert "CX_LAUNCH(" not in cuda and "CX_LAUNCH_COOPERATIVE(" not in cuda and "cudaDeviceSynchronize" not in cuda
    assert "cudaMemcpy(" not in cuda and "cudaMemset(" not in cuda
    assert "getenv" not in cuda and "CORTEXC_" not in cuda.replace("CORTEXC_CUDA", "")


def test_a_cuda_library_without_the_stream_abi_is_a_typed_error():
    """A library built from an older package (no cx_mem_sync: its copies take no stream) is refused with a
    typed error saying what to do, not an AttributeError."""
    import types

    from cortexc.targets.cuda.host import DeviceMemory

    old = types.SimpleNamespace(**{name: lambda *a: 0 for name in abi.DEVICE_MEMORY_EXPORTS if name != "cx_mem_sync"})
    with pytest.raises(CortexcError, match="lacks cx_mem_sync.*compile the package again"):
        DeviceMemory(old)


def test_launch_options_from_the_environment():
    assert LaunchOptions.from_environment({}) == LaunchOptions()
    options = LaunchOptions.from_environment(
        {"CORTEXC_CUDA_MODE": "levels", "CORTEXC_CUDA_BLOCKS": "3", "CORTEXC_CUDA_WEIGHTS": "global"}
    )
    assert options == LaunchOptions(LaunchMode.LEVELS, 3, True)
    struct = options.struct()
    assert (struct.mode, struct.max_blocks, struct.weights_global) == (abi.LAUNCH_MODES["levels"], 3, 1)
    with pytest.raises(Exception, match="not a launch mode"):
        LaunchOptions.from_environment({"CORTEXC_CUDA_MODE": "fastest"})
    with pytest.raises(Exception, match="not a number"):
        LaunchOptions.from_environment({"CORTEXC_CUDA_BLOCKS": "many"})


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the emulated CUDA build)")
def test_explicit_launch_options_win_over_the_environment(rng, tmp_path, monkeypatch):
    """An executor given LaunchOptions launches as they say whatever the environment says; without them the
    environment is read at each call."""
    import cortexc
    from cortexc import Forest
    from cortexc.runtime.linearize import linearize
    from cortexc.targets.cuda.emulated import EmulatedCudaExecutor
    from tests.helpers import random_inputs, relative_error

    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path / "cache"))
    module = cortexc.load(EXAMPLES / "treernn.cell", out_dir=tmp_path, X=4, H=6)
    cls = getattr(module, module.__all__[0])
    reference = cls(device="interp", seed=2)
    forest = Forest.random(3, rng=rng, binary=True, max_nodes=9)
    inputs = random_inputs(reference.cell, forest, rng)
    expected = reference(forest, **inputs)
    source = cls._kernel_sources["cuda"]
    fixed = EmulatedCudaExecutor(cls._spec, source, "launch_options", LaunchOptions(LaunchMode.LEVELS))
    from_environment = EmulatedCudaExecutor(cls._spec, source, "launch_options")
    monkeypatch.setenv("CORTEXC_CUDA_MODE", "persistent")
    for executor, launches in ((fixed, forest.num_levels), (from_environment, 1)):
        executor.set_params(reference.params)
        got, _ = executor.forward(linearize(forest), inputs)
        assert relative_error(got["h"], expected["h"]) < 1e-5
        count = executor.lib.cx_last_launch_count()
        assert count == 1 if launches == 1 else count >= launches


def test_the_environment_changes_only_what_it_sets_of_a_default():
    default = LaunchOptions(LaunchMode.LEVELS, 5, True)
    assert LaunchOptions.from_environment({}, default) == default
    assert LaunchOptions.from_environment({"CORTEXC_CUDA_MODE": "split"}, default) == LaunchOptions(
        LaunchMode.SPLIT, 5, True
    )
    assert LaunchOptions.from_environment({"CORTEXC_CUDA_WEIGHTS": ""}, default).weights_global is False
    assert LaunchOptions.from_json(default.to_json()) == default
    with pytest.raises(CortexcError, match="malformed launch options"):
        LaunchOptions.from_json({"mode": "sideways", "max_blocks": 0, "weights_global": False})


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found (the emulated CUDA build)")
def test_a_package_compiled_with_launch_options_launches_by_them(rng, tmp_path, monkeypatch):
    """`CompileOptions.launch` is the package's default (in cell.json, part of the cache key); the
    environment still overrides it at run time."""
    from cortexc import Forest
    from cortexc.options import KNOWN_TARGETS, CompileOptions
    from cortexc.pipeline import write_package
    from cortexc.runtime.loader import import_package
    from tests.helpers import random_inputs, relative_error

    monkeypatch.setenv("CORTEXC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CORTEXC_CUDA_MODE", raising=False)
    path = EXAMPLES / "treernn.cell"
    options = CompileOptions.make({"X": 4, "H": 6}, KNOWN_TARGETS, launch=LaunchOptions(LaunchMode.LEVELS))
    assert options.key(path.read_text(), str(path)) != CompileOptions.make({"X": 4, "H": 6}, KNOWN_TARGETS).key(
        path.read_text(), str(path)
    )
    module = import_package(write_package(path.read_text(), str(path), tmp_path / "pkg", options))
    cls = getattr(module, module.__all__[0])
    assert cls._spec.launch.mode == LaunchMode.LEVELS
    forest = Forest.random(3, rng=rng, binary=True, min_nodes=5, max_nodes=9)  # 3 levels at least
    reference = cls(device="interp", seed=1)
    inputs = random_inputs(cls.signature, forest, rng)
    expected = reference(forest, **inputs)
    model = cls(device="cuda-emu", seed=1)
    for environment, launches in ((None, forest.num_levels), ("persistent", 1)):
        if environment is not None:
            monkeypatch.setenv("CORTEXC_CUDA_MODE", environment)
        got = model(forest, **inputs)
        assert relative_error(got["h"], expected["h"]) < 1e-5
        count = model._executor.lib.cx_last_launch_count()
        assert count == 1 if launches == 1 else count >= launches


def test_cortexc_compile_writes_the_launch_options_it_is_given(tmp_path):
    import json

    from cortexc.cli import main

    out = tmp_path / "out"
    argv = ["compile", str(EXAMPLES / "treernn.cell"), "-o", str(out), "--cuda-mode", "persistent"]
    assert main([*argv, "--cuda-blocks", "8", "--cuda-weights", "global"]) == 0
    spec = json.loads((out / "treernn" / "cell.json").read_text())["cells"][0]
    assert spec["launch"] == {"mode": "persistent", "max_blocks": 8, "weights_global": True}
    (cell,) = PackageSpec.from_json(json.loads((out / "treernn" / "cell.json").read_text())).cells
    assert cell.launch == LaunchOptions(LaunchMode.PERSISTENT, 8, True)
