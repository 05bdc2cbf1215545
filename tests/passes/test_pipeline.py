"""The pipeline's stages: golden IR dumps of every example, the verifier, printer determinism."""

from __future__ import annotations

import dataclasses
import os

import pytest

from cortexc.codegen.target import TARGETS
from cortexc.errors import CortexcError
from cortexc.ir.cell import Body, Value
from cortexc.ir.ops import Domain, Op
from cortexc.ir.printer import format_cell
from cortexc.ir.program import Gemm, Loop, Store
from cortexc.ir.verify import IRVerifyError, verify_cell
from cortexc.ir.verify_program import ProgramVerifyError, verify_program
from cortexc.options import KNOWN_TARGETS, CompileOptions
from cortexc.pipeline import Source, compile_file, compile_package, run_stages
from tests.helpers import EXAMPLES, REPO

GOLDEN = REPO / "tests" / "golden"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.cell"))


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_ir_dumps_match_the_golden_files(path, tmp_path):
    """Every stage with a text form, cells and scheduled programs (per target), against its golden file."""
    options = CompileOptions.make(targets=KNOWN_TARGETS, dump_dir=tmp_path)
    compile_package(path.read_text(), str(path.relative_to(REPO)), options)
    dumps = sorted(tmp_path.iterdir())
    stages = {d.name.split(".")[1].split("-", 1)[1] for d in dumps}
    assert stages == {"lower", "specialize", "hoist", "autodiff", "schedule", "target"}
    assert {d.suffix for d in dumps} == {".ir", ".prog"}
    for dump in dumps:
        golden = GOLDEN / dump.name
        text = dump.read_text()
        if os.environ.get("CORTEXC_UPDATE_GOLDEN"):
            golden.write_text(text)
        assert golden.exists(), f"no golden file {golden.name}; run with CORTEXC_UPDATE_GOLDEN=1"
        assert text == golden.read_text(), f"{dump.name} differs from its golden file"


@pytest.mark.parametrize("stem", ["treernn", "lstm"])
def test_rendered_kernels_match_the_golden_files(stem):
    """The rendered C and CUDA of two examples, whole: a change to a template or to what the passes give it
    shows in review as a diff of these files (`CORTEXC_UPDATE_GOLDEN=1` writes them)."""
    path = EXAMPLES / f"{stem}.cell"
    options = CompileOptions.make(targets=KNOWN_TARGETS)
    rendered = run_stages(Source(path.read_text(), str(path.relative_to(REPO))), options, until="render")
    names = []
    for item in rendered:
        for target, text in item.sources:
            golden = GOLDEN / f"{item.cell.name}{TARGETS[target].source_suffix}"
            names.append(golden.name)
            if os.environ.get("CORTEXC_UPDATE_GOLDEN"):
                golden.write_text(text)
            assert golden.exists(), f"no golden file {golden.name}; run with CORTEXC_UPDATE_GOLDEN=1"
            assert text == golden.read_text(), f"{golden.name} differs from its golden file"
    assert sorted(names) == sorted(f"{rendered[0].cell.name}{suffix}" for suffix in (".c", ".cu"))


def test_printing_is_deterministic():
    first = [format_cell(c) for c in compile_file(EXAMPLES / "mvrnn.cell")]
    second = [format_cell(c) for c in compile_file(EXAMPLES / "mvrnn.cell")]
    assert first == second


def _with_node_values(cell, values):
    return dataclasses.replace(cell, node=dataclasses.replace(cell.node, values=tuple(values)))


def test_verifier_accepts_every_example():
    for path in EXAMPLE_FILES:
        for cell in compile_file(path):
            verify_cell(cell)


def test_verifier_rejects_a_wrong_shape():
    cell = compile_file(EXAMPLES / "treelstm.cell")[0]
    values = list(cell.node.values)
    index = next(i for i, v in enumerate(values) if v.op == Op.MATMUL)
    values[index] = dataclasses.replace(values[index], shape=(7,))
    with pytest.raises(IRVerifyError, match="shape"):
        verify_cell(_with_node_values(cell, values))


def test_verifier_rejects_a_forward_reference():
    cell = compile_file(EXAMPLES / "treelstm.cell")[0]
    values = list(cell.node.values)
    index = next(i for i, v in enumerate(values) if v.op == Op.TANH)
    values[index] = dataclasses.replace(values[index], args=(len(values) - 1,))
    with pytest.raises(IRVerifyError, match="earlier value"):
        verify_cell(_with_node_values(cell, values))


def test_verifier_rejects_a_wrong_domain():
    cell = compile_file(EXAMPLES / "dagrnn.cell")[0]
    values = list(cell.node.values)
    index = next(i for i, v in enumerate(values) if v.op == Op.SUM)
    values[index] = dataclasses.replace(values[index], domain=Domain.CHILD)
    with pytest.raises(IRVerifyError):
        verify_cell(_with_node_values(cell, values))


def test_verifier_rejects_children_in_a_leaf_body():
    cell = compile_file(EXAMPLES / "treernn.cell")[0]
    child = Value(Op.CHILD_STATE_AT, (), (64,), Domain.NODE, (("name", "h"), ("k", 0)))
    leaf = Body(cell.leaf.kind, (child,), (("h", 0),))
    with pytest.raises(IRVerifyError, match="children are read only in node bodies"):
        verify_cell(dataclasses.replace(cell, leaf=leaf))


def test_verifier_rejects_missing_state_results():
    cell = compile_file(EXAMPLES / "lstm.cell")[0]
    node = dataclasses.replace(cell.node, results=cell.node.results[:1])
    with pytest.raises(IRVerifyError, match="not the states"):
        verify_cell(dataclasses.replace(cell, node=node))


# ------------------------------------------------------------ the whole pipeline and the Program verifier


def _cuda_program(name: str = "treelstm.cell"):
    from cortexc.pipeline import Source, run_stages

    path = EXAMPLES / name
    options = CompileOptions.make(targets=("cuda",))
    per_cell = run_stages(Source(path.read_text(), str(path)), options, until="target")
    return per_cell[0][0].program


def test_every_stage_is_named_in_order_and_documents_its_contract():
    from cortexc.pipeline import _stages, stage_names

    assert stage_names() == (
        "parse",
        "lower",
        "specialize",
        "hoist",
        "autodiff",
        "schedule",
        "target",
        "render",
        "package",
    )
    for stage in _stages():
        assert stage.run.__doc__ and "Guarantees" in stage.run.__doc__, stage.name


def test_compile_options_are_checked_and_key_what_shapes_the_output(tmp_path):
    with pytest.raises(CortexcError, match="target 'metal' is not available"):
        CompileOptions.make(targets=("metal",))
    base = CompileOptions.make({"H": 4})
    assert base.key("src", "a.cell") == CompileOptions.make({"H": 4}, dump_dir=tmp_path).key("src", "a.cell")
    others = [
        CompileOptions.make({"H": 5}).key("src", "a.cell"),
        CompileOptions.make({"H": 4}, targets=("c", "cuda")).key("src", "a.cell"),
        base.key("src2", "a.cell"),
        base.key("src", "b.cell"),
    ]
    assert base.key("src", "a.cell") not in others and len(set(others)) == len(others)


def test_program_verifier_accepts_every_example_program():
    for path in EXAMPLE_FILES:
        program = _cuda_program(path.name)
        assert verify_program(program) is program


def _replace_step(program, kernel_name, predicate, change):
    kernels = []
    for kernel in program.kernels:
        if kernel.name == kernel_name:
            number = next(i for i, s in enumerate(kernel.steps) if predicate(s))
            steps = list(kernel.steps)
            steps[number] = change(steps[number])
            kernel = dataclasses.replace(kernel, steps=tuple(steps))
        kernels.append(kernel)
    return dataclasses.replace(program, kernels=tuple(kernels))


def test_program_verifier_rejects_an_unknown_packed_weight():
    program = _replace_step(
        _cuda_program(), "node", lambda s: isinstance(s, Gemm), lambda s: dataclasses.replace(s, packed="w99")
    )
    with pytest.raises(ProgramVerifyError, match="kernel node: .*unknown packed weight 'w99'"):
        verify_program(program, "test")


def test_program_verifier_rejects_a_loop_past_its_buffer():
    program = _replace_step(
        _cuda_program(), "leaf", lambda s: isinstance(s, Loop), lambda s: dataclasses.replace(s, width=s.width + 1)
    )
    with pytest.raises(ProgramVerifyError, match="overflows buffer"):
        verify_program(program)


def test_program_verifier_rejects_a_store_of_the_wrong_width():
    program = _replace_step(
        _cuda_program(), "node", lambda s: isinstance(s, Store), lambda s: dataclasses.replace(s, width=s.width * 2)
    )
    with pytest.raises(ProgramVerifyError, match="width"):
        verify_program(program)


def test_program_verifier_rejects_a_deferred_term_without_its_step():
    program = _cuda_program()
    assert program.deferred
    wrong = dataclasses.replace(program.deferred[0], step=0)  # step 0 of a gradient kernel is no AccumOuter
    with pytest.raises(ProgramVerifyError, match="is not its AccumOuter"):
        verify_program(dataclasses.replace(program, deferred=(wrong, *program.deferred[1:])))


def test_program_verifier_rejects_a_split_that_misses_steps():
    program = _cuda_program()
    kernels = tuple(
        dataclasses.replace(k, split=dataclasses.replace(k.split, split_steps=k.split.split_steps[:-1]))
        if k.split is not None
        else k
        for k in program.kernels
    )
    with pytest.raises(ProgramVerifyError, match="does not cover every step"):
        verify_program(dataclasses.replace(program, kernels=kernels))


def test_the_target_stage_splits_columns_and_defers_outer_products_only_where_the_target_does():
    from cortexc.pipeline import Source, run_stages

    path = EXAMPLES / "binary_treelstm.cell"
    options = CompileOptions.make(targets=KNOWN_TARGETS)
    (variants,) = run_stages(Source(path.read_text(), str(path)), options, until="target")
    by_target = {v.target: v.program for v in variants}
    assert by_target["cuda"].kernel("node").split is not None and by_target["cuda"].deferred
    assert by_target["c"].kernel("node").split is None
    # C defers always only the weights whose accumulator would not stay in cache; W_s (5 x 150) is narrow:
    # deferred by launches of few rows only
    assert {t.param for t in by_target["cuda"].deferred} == {"W_s", "U_f", "U_iou", "W_iou"}
    assert not any(t.narrow for t in by_target["cuda"].deferred)
    assert {t.param for t in by_target["c"].deferred if not t.narrow} == {"U_f", "U_iou", "W_iou"}
    assert {t.param for t in by_target["c"].deferred if t.narrow} == {"W_s"}
