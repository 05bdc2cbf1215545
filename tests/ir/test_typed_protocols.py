"""Typed values between the passes: gradient targets, store targets and modes, structure properties."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cortexc.ir.cell import GradKind, GradTarget, Structure
from cortexc.ir.program import Store, StoreMode, StoreTarget
from cortexc.ir.verify import IRVerifyError, verify_cell
from cortexc.passes.schedule import schedule
from cortexc.pipeline import compile_file, compile_source
from tests.helpers import EXAMPLES
from tests.ir.test_autodiff import INVENTED


def test_grad_targets_print_as_the_dumps_spell_them():
    assert str(GradTarget(GradKind.PARAM, "W")) == "d_param/W"
    assert str(GradTarget(GradKind.EMBED, "E", index="w")) == "d_embed/E/w"
    assert str(GradTarget(GradKind.CHILD_AT, "h", k=1)) == "d_child_at/1/h"
    assert f"{GradTarget(GradKind.HOISTED, 'pre0')}" == "d_hoisted/pre0"


@pytest.mark.parametrize(
    "kind, extra",
    [(GradKind.CHILD_AT, {}), (GradKind.EMBED, {}), (GradKind.PARAM, {"k": 0}), (GradKind.STATE, {"index": "w"})],
)
def test_grad_targets_carry_k_and_index_exactly_when_they_need_them(kind, extra):
    with pytest.raises(ValueError):
        GradTarget(kind, "h", **extra)


def _cell(name: str):
    return compile_source(INVENTED[name][1], f"{name}.cell", None)[0]


def test_gradient_bodies_are_keyed_by_targets_and_forward_bodies_by_names():
    cell = _cell("embed")
    grads = cell.grads
    keys = {key for body in (grads.leaf, grads.node, *grads.outputs) for key, _ in body.grad_results}
    assert GradTarget(GradKind.EMBED, "E", index="w") in keys and GradTarget(GradKind.CHILD, "h") in keys
    assert [name for name, _ in cell.node.named_results] == ["h"]
    with pytest.raises(TypeError):
        _ = cell.node.grad_results
    with pytest.raises(TypeError):
        _ = grads.node.named_results


def test_the_verifier_rejects_a_gradient_result_named_by_a_string():
    cell = _cell("embed")
    (target, index), *rest = cell.grads.node.results
    spelled = replace(cell.grads.node, results=((str(target), index), *rest))
    with pytest.raises(IRVerifyError, match="gradient targets"):
        verify_cell(replace(cell, grads=replace(cell.grads, node=spelled)))


def _stores(cell, *kernels: str) -> dict[StoreTarget, StoreMode]:
    """Store target -> mode over the named kernels (every kernel if none is named)."""
    program = schedule(cell)
    chosen = [program.kernel(name) for name in kernels] if kernels else program.kernels
    return {s.target: s.mode for k in chosen for s in k.steps if isinstance(s, Store)}


def test_store_modes_follow_the_target_and_the_structure():
    tree = _stores(_cell("embed"))
    assert tree[StoreTarget.D_CHILD] == StoreMode.ADD  # a tree child has one parent
    assert tree[StoreTarget.D_EMBED] == StoreMode.ATOMIC_ADD  # nodes may share a table row
    assert tree[StoreTarget.D_HOISTED] == StoreMode.SET and tree[StoreTarget.PRE] == StoreMode.SET
    dag_cell = compile_file(EXAMPLES / "dagrnn.cell", {})[0]
    assert dag_cell.structure.shares_children and not Structure.TREE.shares_children
    assert _stores(dag_cell, "grad_node")[StoreTarget.D_CHILD] == StoreMode.ATOMIC_ADD
    assert _stores(dag_cell, "node") == {StoreTarget.STATE: StoreMode.SET}
