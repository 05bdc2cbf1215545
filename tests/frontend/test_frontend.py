"""The front end accepts every program the spec allows, with the meaning the spec gives it.

The examples (the spec's own programs) parse, check and lower; `-D` overrides
change their shapes; and valid-but-unusual forms are accepted and lowered to
the IR they mean. Meaning is checked on the IR with `tree()`, which writes the
value a result is computed from as a nested expression, e.g.
``add(param:b, sum(child_state:h))``.
"""

from __future__ import annotations

import re

import pytest

from cortexc.errors import CellTypeError
from cortexc.frontend import lower_source, parse
from cortexc.ir.cell import Body, Cell, Init, InitKind, Structure
from cortexc.ir.verify import verify_cell
from tests.helpers import EXAMPLES, EXAMPLES_BY_NAME

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.cell"))


def lower_one(source: str, **defines: int) -> Cell:
    cells = lower_source(source, "t.cell", defines=defines or None)
    assert len(cells) == 1
    return verify_cell(cells[0])


def tree(body: Body, name: str) -> str:
    """The value of result `name` as a nested expression of ops (leaves show their name or value)."""

    def show(index: int) -> str:
        value = body.values[index]
        attrs = dict(value.attrs)
        if "name" in attrs or "value" in attrs:
            leaf = f"{value.op.value}:{attrs.get('name', attrs.get('value'))}"
            return leaf + (f"[{attrs['k']}]" if "k" in attrs else "")
        inner = ", ".join(show(a) for a in value.args)
        extra = f"[{attrs['lo']}:{attrs['hi']}]" if "lo" in attrs else ""
        return f"{value.op.value}{extra}({inner})"

    return show(body.result(name))


def small(node: str, *, decls: str = "", on: str = "tree", after: str = "") -> str:
    """A cell with dims X = 4, H = 8, an input x, params W, U, b, p, q, a state h, and the given node body."""
    return f"""
cell C on {on} {{
    dim X = 4, H = 8
    input x[X]
    param W[H, X], U[H, H], b[H], p[H], q[H]
    state h[H]
    {decls}
    node {{ {node} }}
    {after}
}}
"""


# ---- the examples ----------------------------------------------------------------------


def test_there_are_examples():
    assert {f.name for f in EXAMPLE_FILES} >= {
        "treelstm.cell",
        "binary_treelstm.cell",
        "treernn.cell",
        "dagrnn.cell",
        "lstm.cell",
        "mvrnn.cell",
    }


@pytest.mark.parametrize("path", list(EXAMPLES_BY_NAME.values()), ids=list(EXAMPLES_BY_NAME))
def test_example_parses_and_lowers(path):
    source = path.read_text()
    module = parse(source, str(path))
    names = re.findall(r"^cell (\w+)", source, flags=re.M)
    assert [c.name for c in module.cells] == names
    cells = lower_source(source, str(path))
    assert [c.name for c in cells] == names
    for cell in cells:
        verify_cell(cell)
        assert cell.source == str(path)
        assert [name for name, _ in cell.node.results] == [s.name for s in cell.states]
        if cell.leaf is not None:
            assert [name for name, _ in cell.leaf.results] == [s.name for s in cell.states]


def example(stem: str, **defines: int) -> Cell:
    path = EXAMPLES / f"{stem}.cell"
    return verify_cell(lower_source(path.read_text(), str(path), defines=defines or None)[0])


def test_treelstm_declarations():
    cell = example("treelstm")
    assert cell.name == "ChildSumTreeLSTM"
    assert cell.structure == Structure.TREE and cell.arity is None
    assert cell.dims == (("X", 300), ("H", 150))
    assert cell.input("x").shape == (300,)
    assert cell.param("W_iou").shape == (450, 300)
    assert cell.param("W_iou").init == Init(InitKind.XAVIER)
    assert cell.param("b_iou").init == Init(InitKind.ZEROS)
    assert cell.state("h").shape == cell.state("c").shape == (150,)
    assert cell.leaf is None
    assert cell.node.reads_children()


def test_binary_treelstm_declarations():
    cell = example("binary_treelstm")
    assert cell.arity == 2
    assert cell.input("word").is_index and cell.input("word").index_range == 21701
    assert cell.param("E").init == Init(InitKind.NORMAL, (0.0, 0.1))
    assert cell.leaf is not None and not cell.leaf.reads_children()
    (logits,) = cell.outputs
    assert (logits.name, logits.shape, logits.at_root) == ("logits", (5,), False)
    assert "embed(param:E, input:word)" in tree(cell.leaf, "c")


def test_chain_and_dag_and_matrix_states():
    assert example("lstm").arity == 1
    dag = example("dagrnn")
    assert dag.structure == Structure.DAG and dag.arity is None
    mv = example("mvrnn")
    assert mv.state("A").shape == (16, 16)
    assert tree(mv.leaf, "A") == "param:A0"
    assert tree(mv.node, "A") == "matmul(param:W_M, concat(child_state_at:A[0], child_state_at:A[1]))"


def test_define_overrides_change_shapes():
    cell = example("treelstm", H=32)
    assert dict(cell.dims) == {"X": 300, "H": 32}
    assert cell.param("W_iou").shape == (96, 300)
    assert cell.param("U_iou").shape == (96, 32)
    assert cell.state("h").shape == (32,)
    # the slices iou[H:2*H] follow the override too
    assert tree(cell.node, "h").startswith("mul(sigmoid(slice[32:64](")


def test_define_overrides_every_cell_that_declares_the_dim():
    source = (
        small("h = b")
        + small("h = b").replace("cell C", "cell D")
        + """
cell E on tree { dim K = 3  state s[K]  node { s = sum(child.s) } }
"""
    )
    cells = {c.name: c for c in lower_source(source, "t.cell", defines={"H": 5, "K": 2})}
    assert cells["C"].state("h").shape == cells["D"].state("h").shape == (5,)
    assert cells["D"].param("W").shape == (5, 4)
    assert cells["E"].state("s").shape == (2,)


def test_define_with_numpy_integer():
    np = pytest.importorskip("numpy")
    assert example("treernn", H=np.int64(8)).state("h").shape == (8,)


# ---- valid but unusual programs -----------------------------------------------------------


def test_semicolons_everywhere():
    cell = lower_one("cell C on tree { dim H = 8; state h[H]; param b[H];; node { ; h = b;; } ; }")
    assert tree(cell.node, "h") == "param:b"


def test_comments_everywhere():
    source = """# leading comment
cell # after the keyword
  C # after the name
  on tree # after the structure
{ # after the brace
  dim H = # inside a declaration
    8 # after a number
  param b[H] # after a param
  state h[ # inside a shape
    H] # after a shape
  node # before a block
  { h # after a target
    = # after =
    b # after a value
  } # after a block
} # after the cell
# trailing comment without newline"""
    assert tree(lower_one(source).node, "h") == "param:b"


def test_statements_on_one_line_without_separators():
    cell = lower_one(small("c = q a = p d = a + q h = d", decls="state c[H]"))
    assert tree(cell.node, "h") == "add(param:p, param:q)"
    assert tree(cell.node, "c") == "param:q"


def test_tuple_assignment_evaluates_every_right_side_first():
    cell = lower_one(small("a, c = p, q; a, c = c, a; h = a - c"))
    assert tree(cell.node, "h") == "sub(param:q, param:p)"


def test_tuple_assignment_of_states():
    cell = lower_one(small("h, c = sum(child.c) + b, sum(child.h)", decls="state c[H]"))
    assert tree(cell.node, "h") == "add(sum(child_state:c), param:b)"
    assert tree(cell.node, "c") == "sum(child_state:h)"


def test_sum_of_a_constant_counts_the_children():
    cell = lower_one(small("h = b * sum(1)"))
    assert tree(cell.node, "h") == "mul(param:b, sum(expand(const:1.0)))"


def test_a_reduction_takes_per_child_values_and_numbers_only():
    """Version 3: `mean(b)` of a per-node b is an error (Version 2 took b once per child); a number is taken
    once per child, so `sum(1)` counts the children."""
    cell = lower_one(small("h = b * sum(1) + max(child.h)"))
    assert tree(cell.node, "h") == "add(mul(param:b, sum(expand(const:1.0))), max(child_state:h))"
    with pytest.raises(CellTypeError, match="mean reduces over the children, but b is the same for every child"):
        lower_one(small("h = mean(b) + max(child.h)"))


def test_dims_are_scalars_in_expressions():
    cell = lower_one(small("h = b * H + X / 2 - (H)"))
    assert tree(cell.node, "h") == "sub(add(mul(param:b, const:8.0), div(const:4.0, const:2.0)), const:8.0)"
    assert "const:3.0" in tree(lower_one(small("h = b * H"), H=3).node, "h")


def test_slices_with_omitted_bounds():
    cell = lower_one(small("h = v[:H] + v[H:]", decls="param v[2*H]"))
    assert tree(cell.node, "h") == "add(slice[0:8](param:v), slice[8:16](param:v))"
    cell = lower_one(small("h = v[:]", decls="param v[H]"))
    assert tree(cell.node, "h") == "slice[0:8](param:v)"


def test_slice_bounds_are_constant_expressions():
    cell = lower_one(small("h = v[H/2 : 2*H - H/2]", decls="param v[2*H+1]"))
    assert cell.param("v").shape == (17,)
    assert tree(cell.node, "h") == "slice[4:12](param:v)"


def test_slice_of_a_computed_per_child_value():
    cell = lower_one(small("h = sum((U @ child.h)[0:H])"))
    assert tree(cell.node, "h") == "sum(slice[0:8](matmul(param:U, child_state:h)))"


def test_dag_with_arity():
    cell = lower_one(small("h = b + child[1].h - child[0].h", on="dag(arity = 2)"))
    assert cell.structure == Structure.DAG and cell.arity == 2
    assert tree(cell.node, "h") == "sub(add(param:b, child_state_at:h[1]), child_state_at:h[0])"


def test_child_number_may_use_dims():
    cell = lower_one(small("h = child[H - 7].h", on="tree(arity = 2)"))
    assert tree(cell.node, "h") == "child_state_at:h[1]"


def test_matrix_states_and_matrix_products():
    cell = lower_one(small("M = sum(child.M) @ U + U; h = M @ b", decls="state M[H, H]"))
    assert cell.state("M").shape == (8, 8)
    assert tree(cell.node, "M") == "add(matmul(sum(child_state:M), param:U), param:U)"
    assert tree(cell.node, "h") == "matmul(add(matmul(sum(child_state:M), param:U), param:U), param:b)"


def test_outputs_per_node_and_at_root():
    cell = lower_one(
        small(
            "h = b",
            decls="dim C = 3\n    param V[C, H]",
            after="output y[C] at root = V @ h\n    output z[H] = tanh(h) + W @ x",
        )
    )
    y, z = cell.outputs
    assert (y.name, y.shape, y.at_root) == ("y", (3,), True)
    assert (z.name, z.shape, z.at_root) == ("z", (8,), False)
    assert tree(y.body, "y") == "matmul(param:V, state:h)"


def test_negative_and_signed_init_arguments():
    cell = lower_one(small("h = b", decls="param A[H, H] init uniform(-0.1, 0.1), B[H] init normal(-1, +2e-1)"))
    assert cell.param("A").init == Init(InitKind.UNIFORM, (-0.1, 0.1))
    assert cell.param("B").init == Init(InitKind.NORMAL, (-1.0, 0.2))


def test_each_init_belongs_to_the_item_it_follows():
    cell = lower_one(small("h = b", decls="param A[H, H] init ones, B[H, H], C[H] init normal(0, 1), D[H]"))
    assert cell.param("A").init == Init(InitKind.ONES)
    assert cell.param("B").init == Init(InitKind.XAVIER)  # default for a matrix
    assert cell.param("C").init == Init(InitKind.NORMAL, (0.0, 1.0))
    assert cell.param("D").init == Init(InitKind.ZEROS)  # default for a vector


def test_numbers_in_every_form():
    cell = lower_one(small("h = b * 1e-3 + b * .5 + b * 2. + b * 1E+2"))
    assert [v.attr("value") for v in cell.node.values if v.op.value == "const"] == [0.001, 0.5, 2.0, 100.0]


def test_unary_plus_and_minus():
    cell = lower_one(small("h = -b - -b + +b"))
    assert tree(cell.node, "h") == "add(sub(neg(param:b), neg(param:b)), param:b)"


def test_precedence_and_associativity():
    cell = lower_one(small("h = b - p - q * b / p + W @ x * 2"))
    assert tree(cell.node, "h") == (
        "add(sub(sub(param:b, param:p), div(mul(param:q, param:b), param:p)), mul(matmul(param:W, input:x), const:2.0))"
    )


def test_every_function():
    body = "softmax(b) + log_softmax(b) + relu(exp(log(abs(softplus(sigmoid(tanh(b)))))))"
    assert lower_one(small(f"h = {body}")).node.values


def test_names_that_start_with_keywords_are_names():
    cell = lower_one(
        small(
            "nodes = b; leafy = nodes; children = leafy; index_ = children; cells = index_; h = cells + dimension",
            decls="param dimension[H]",
        )
    )
    assert tree(cell.node, "h") == "add(param:b, param:dimension)"


def test_function_names_are_not_reserved():
    cell = lower_one(small("tanh_ = b; sum_ = tanh_; h = tanh(sum_)"))
    assert tree(cell.node, "h") == "tanh(param:b)"


def test_embedding_lookup_with_index_range_expression():
    cell = lower_one(
        small("h = E[w] + sum(child.h)", decls="dim V = 10\n    input w : index[V + 2]\n    param E[2*V, H]")
    )
    assert cell.input("w").index_range == 12
    assert tree(cell.node, "h") == "add(embed(param:E, input:w), sum(child_state:h))"


def test_leaf_block_and_node_block_in_any_order():
    cell = lower_one(small("h = sum(child.h)").replace("node {", "leaf { h = b }\n    node {"))
    assert tree(cell.leaf, "h") == "param:b" and tree(cell.node, "h") == "sum(child_state:h)"
    reordered = small("h = sum(child.h)", after="").replace(
        "    node { h = sum(child.h) }", "    node { h = sum(child.h) } leaf { h = b }"
    )
    cell = lower_one(reordered)
    assert tree(cell.leaf, "h") == "param:b"


def test_declarations_in_any_order():
    source = """cell C on tree {
    state h[H]
    param W[H, X]
    input x[X]
    dim H = 8, X = 4
    node { h = W @ x }
}"""
    assert lower_one(source).state("h").shape == (8,)


def test_tabs_and_crlf_line_endings():
    source = "cell C on tree {\r\n\tdim H = 8\r\n\tparam b[H]\r\n\tstate h[H]\r\n\tnode {\r\n\t\th =\tb\r\n\t}\r\n}\r\n"
    assert tree(lower_one(source).node, "h") == "param:b"


def test_several_cells_in_one_file():
    source = small("h = b") + "\ncell D on dag { dim K = 2  state s[K]  node { s = sum(child.s) } }\n"
    assert [c.name for c in lower_source(source, "t.cell")] == ["C", "D"]


def test_local_names_may_be_reassigned():
    cell = lower_one(small("a = b; a = a * 2; h = a"))
    assert tree(cell.node, "h") == "mul(param:b, const:2.0)"


def test_unused_locals_are_dropped():
    cell = lower_one(small("unused = W @ x; h = b"))
    assert [v.op.value for v in cell.node.values] == ["param"]
