"""The pipeline's stages: golden IR dumps of every example, the verifier, printer determinism."""

from __future__ import annotations

import dataclasses
import os

import pytest

from cortexc.ir.cell import Body, Value
from cortexc.ir.ops import Domain, Op
from cortexc.ir.printer import format_cell
from cortexc.ir.verify import IRVerifyError, verify_cell
from cortexc.pipeline import compile_file
from tests.helpers import EXAMPLES, REPO

GOLDEN = REPO / "tests" / "golden"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.cell"))


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_ir_dumps_match_the_golden_files(path, tmp_path):
    compile_file(path, dump_dir=tmp_path)
    dumps = sorted(tmp_path.iterdir())
    assert dumps
    for dump in dumps:
        golden = GOLDEN / dump.name
        text = dump.read_text()
        if os.environ.get("CORTEXC_UPDATE_GOLDEN"):
            golden.write_text(text)
        assert golden.exists(), f"no golden file {golden.name}; run with CORTEXC_UPDATE_GOLDEN=1"
        assert text == golden.read_text(), f"{dump.name} differs from its golden file"


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
