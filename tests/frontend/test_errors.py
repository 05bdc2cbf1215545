"""Every mistake a user can make in a `.cell` file is a located, typed error.

Each case is a small malformed program, checked for the exact exception class,
line, column and a distinctive part of the message. Most programs are built
from `cell()`: the standard declarations below sit on lines 2-5, so the first
block is on line 6; `node("...")` puts a one-line node block there, whose body
starts at column 12 (``    node { ``).
"""

from __future__ import annotations

import pytest

from cortexc.errors import CellError, CellSyntaxError, CellTypeError, DimError
from cortexc.frontend import lower_source
from tests.helpers import EXAMPLES

DECLS = (
    "    dim X = 4, H = 8",  # line 2
    "    input x[X]",  # line 3
    "    param W[H, X], U[H, H], b[H]",  # line 4
    "    state h[H]",  # line 5
)

#: declarations for embedding look-ups (same line numbers as DECLS)
INDEX_DECLS = (
    "    dim V = 10, H = 8",
    "    input w : index[V], x[H]",
    "    param E[V, H], F[4, H], b[H]",
    "    state h[H]",
)

ARITY2 = "tree(arity = 2)"


def prog(*lines: str) -> str:
    """Source text with one argument per line (line numbers = position + 1)."""
    return "\n".join(lines) + "\n"


def cell(*items: str, on: str = "tree", decls: tuple[str, ...] = DECLS) -> str:
    """`cell C on <on> {`, the declarations (lines 2-5), then `items` from line 6, then `}`."""
    return prog(f"cell C on {on} {{", *decls, *items, "}")


def node(body: str, *after: str, **kw) -> str:
    """A cell whose node block is the one line 6 ``    node { <body> }``; the body starts at column 12."""
    return cell(f"    node {{ {body} }}", *after, **kw)


def lower_error(source: str, defines: dict | None = None) -> CellError:
    """The error `lower_source` raises for `source` (fails the test if it raises nothing)."""
    with pytest.raises(CellError) as info:
        lower_source(source, "t.cell", defines=defines)
    return info.value


def check(
    source: str, cls: type[CellError], line: int, col: int, fragment: str, defines: dict | None = None
) -> CellError:
    err = lower_error(source, defines)
    shown = err.format()
    assert type(err) is cls, shown
    assert err.loc is not None, shown
    assert (err.loc.line, err.loc.col) == (line, col), shown
    assert err.loc.file == "t.cell"
    assert fragment in err.message, shown
    return err


# (id, source, class, line, col, message fragment)
CASES = [
    # ---- syntax ------------------------------------------------------------------
    (
        "eof-missing-brace",
        prog("cell C on tree {", "    state h[1]", "    node { h = h }"),
        CellSyntaxError,
        3,
        19,
        "unexpected end of file, expected '}'",
    ),
    (
        "eof-inside-expression",
        prog("cell C on tree {", "    state h[1]", "    node { h = tanh("),
        CellSyntaxError,
        3,
        21,
        "unexpected end of file",
    ),
    ("bad-token-after-operator", node("h = b + }"), CellSyntaxError, 6, 20, "unexpected '}', expected one of"),
    ("two-operators", node("h = b * / b"), CellSyntaxError, 6, 20, "unexpected '/'"),
    ("unexpected-character", node("h = b $ b"), CellSyntaxError, 6, 18, "unexpected character '$'"),
    ("unexpected-unicode-character", node("h = b \u00d7 2"), CellSyntaxError, 6, 18, "unexpected character '\u00d7'"),
    ("keyword-as-local-name", node("leaf = b; h = leaf"), CellSyntaxError, 6, 12, "unexpected 'leaf'"),
    (
        "keyword-as-state-name",
        cell("    state root[H]", "    node { h = b }"),
        CellSyntaxError,
        6,
        11,
        "unexpected 'root', expected a name",
    ),
    (
        "keyword-as-param-name",
        cell("    param index[H]", "    node { h = b }"),
        CellSyntaxError,
        6,
        11,
        "unexpected 'index', expected a name",
    ),
    ("missing-equals", node("h tanh(b)"), CellSyntaxError, 6, 14, "unexpected 'tanh', expected one of ',', '='"),
    (
        "missing-equals-in-dim",
        prog("cell C on tree {", "    dim H 8"),
        CellSyntaxError,
        2,
        11,
        "unexpected '8', expected '='",
    ),
    (
        "unknown-structure",
        prog("cell C on tre {", "}"),
        CellSyntaxError,
        1,
        11,
        "expected one of 'dag', 'graph', 'tree'",
    ),
    (
        "arity-not-a-number",
        prog("cell C on tree(arity = H) {", "}"),
        CellSyntaxError,
        1,
        24,
        "unexpected 'H', expected a number",
    ),
    (
        "negative-size-is-syntax",
        cell("    input y[-X]", "    node { h = b }"),
        CellSyntaxError,
        6,
        13,
        "unexpected '-'",
    ),
    ("division-in-a-shape", cell("    input y[H/2]", "    node { h = b }"), CellSyntaxError, 6, 14, "unexpected '/'"),
    (
        "extra-closing-brace",
        node("h = b") + "}\n",
        CellSyntaxError,
        8,
        1,
        "unexpected '}', expected one of 'cell', end of file",
    ),
    ("statement-outside-a-block", cell("    h = b"), CellSyntaxError, 6, 5, "unexpected 'h'"),
    ("child-without-dot", node("h = sum(child)"), CellSyntaxError, 6, 25, "unexpected ')', expected one of '.', '['"),
    # ---- unknown names -----------------------------------------------------------
    (
        "unknown-name-did-you-mean",
        node("h = tanh(W @ x + bb)"),
        CellTypeError,
        6,
        29,
        "unknown name 'bb' (did you mean 'b'?)",
    ),
    (
        "unknown-name-in-output",
        node("h = b", "    output y[H] = zzz"),
        CellTypeError,
        7,
        19,
        "unknown name 'zzz' (outputs read the node's states, inputs and params)",
    ),
    (
        "block-local-unknown-in-output",
        node("a = b; h = a", "    output y[H] = a"),
        CellTypeError,
        7,
        19,
        "unknown name 'a'",
    ),
    (
        "unknown-function-did-you-mean",
        node("h = sigmod(b)"),
        CellTypeError,
        6,
        16,
        "unknown function 'sigmod' (did you mean 'sigmoid'?)",
    ),
    ("unknown-function", node("h = frobnicate(b)"), CellTypeError, 6, 16, "unknown function 'frobnicate'"),
    ("function-arg-count", node("h = tanh(b, b)"), CellTypeError, 6, 16, "tanh takes one argument, got 2"),
    (
        "power-operator",
        node("h = b ** 2"),
        CellSyntaxError,
        6,
        19,
        "there is no power operator '**': write x * x for a square",
    ),
    (
        "parent-in-a-bottom-up-cell",
        node("h = parent.h"),
        CellTypeError,
        6,
        16,
        "parent.h in a bottom-up cell: it reads its children (child.h, child[k].h) and runs a parent after its "
        "children; a cell that reads its parent is written 'cell C on tree down'",
    ),
    (
        "transpose",
        node("h = transpose(U) @ b"),
        CellTypeError,
        6,
        16,
        "unknown function 'transpose': params are used as declared; declare the param transposed",
    ),
    ("reshape", node("h = reshape(U)"), CellTypeError, 6, 16, "unknown function 'reshape': shapes are as declared"),
    (
        "outer",
        node("h = outer(b, b) @ b"),
        CellTypeError,
        6,
        16,
        "unknown function 'outer': an outer product is only used through @, and outer(a, b) @ c is a * dot(b, c)",
    ),
    (
        "reduction-of-a-per-node-value",
        node("h = mean(b)"),
        CellTypeError,
        6,
        16,
        "mean reduces over the children, but b is the same for every child (it reads no per-child value); over a "
        "vector's components, write dot(v, w) for a weighted sum or layernorm(v)",
    ),
    (
        "reduction-of-a-param",
        node("h = b * sum(W)"),
        CellTypeError,
        6,
        20,
        "sum reduces over the children, but W is the same for every child",
    ),
    ("binary-function-arg-count", node("h = minimum(b)"), CellTypeError, 6, 16, "minimum takes two arguments, got 1"),
    (
        "binary-function-shapes",
        node("h = maximum(b, x)"),
        CellTypeError,
        6,
        16,
        "shape mismatch in maximum: [8] and [4] differ",
    ),
    (
        "max-of-two-values",
        node("h = max(b, b)"),
        CellTypeError,
        6,
        16,
        "max(a, b) with two values: for the elementwise maximum write maximum(a, b); max(e) is the maximum over "
        "the children",
    ),
    (
        "min-of-two-values",
        node("h = min(b, b)"),
        CellTypeError,
        6,
        16,
        "min(a, b) with two values: for the elementwise minimum write minimum(a, b)",
    ),
    (
        "dot-of-different-lengths",
        node("h = b * dot(b, x)"),
        CellTypeError,
        6,
        20,
        "shape mismatch in dot: dot of vectors of different lengths, [8] and [4]",
    ),
    ("dot-of-matrices", node("h = b * dot(U, U)"), CellTypeError, 6, 20, "dot takes vectors, but U is [8, 8]"),
    (
        "layernorm-of-a-matrix",
        node("h = layernorm(U)"),
        CellTypeError,
        6,
        16,
        "layernorm takes a vector, but U is [8, 8]",
    ),
    (
        "layernorm-of-one-element",
        node("h = b * layernorm(b[0:1])"),
        CellTypeError,
        6,
        20,
        "layernorm of b[0:1], a [1] value, is always 0 (a layernorm over one element)",
    ),
    (
        "unknown-dim-in-shape",
        cell("    param V[H, Y]", "    node { h = b }"),
        CellTypeError,
        6,
        16,
        "unknown dim 'Y' in a size",
    ),
    (
        "unknown-dim-did-you-mean",
        cell("    state c[HH]", "    node { h = b; c = b }"),
        CellTypeError,
        6,
        13,
        "unknown dim 'HH' in a size (did you mean 'H'?)",
    ),
    (
        "unknown-child-state",
        node("h = sum(child.hh)"),
        CellTypeError,
        6,
        20,
        "the children have no state 'hh' (did you mean 'h'?)",
    ),
    # ---- shapes ------------------------------------------------------------------
    (
        "matmul-mismatch",
        node("h = W @ b"),
        CellTypeError,
        6,
        18,
        "shape mismatch: W @ b multiplies W[8, 4] by b[8]: [8, 4] by [8]: inner dimensions 4 and 8 differ",
    ),
    (
        "matmul-vector-on-the-left",
        node("h = b @ U"),
        CellTypeError,
        6,
        18,
        "the left operand must be a matrix, not [8]",
    ),
    (
        "add-mismatch",
        node("h = b + x"),
        CellTypeError,
        6,
        18,
        "shape mismatch: b + x adds b[8] and x[4]: [8] and [4] differ",
    ),
    (
        "mismatch-message-keeps-parentheses",
        node("h = (b + b) * (x - x)"),
        CellTypeError,
        6,
        24,
        "(b + b) * (x - x) multiplies (b + b)[8] by (x - x)[4]",
    ),
    (
        "concat-vector-and-matrix",
        node("h = concat(b, W)"),
        CellTypeError,
        6,
        16,
        "concat takes all vectors or all matrices, got [8], [8, 4]",
    ),
    (
        "concat-matrices-column-mismatch",
        node("h = concat(W, U)[0:H]"),
        CellTypeError,
        6,
        16,
        "matrices stacked by rows need the same number of columns",
    ),
    (
        "slice-end-out-of-range",
        node("h = b[H:2*H]"),
        CellTypeError,
        6,
        20,
        "b[H:2 * H]: slice [8:16] is out of range for a vector of 8",
    ),
    ("slice-negative-start", node("h = b[-1:]"), CellTypeError, 6, 18, "slice [-1:8] is out of range"),
    (
        "slice-empty",
        node("h = b[4:2]"),
        CellTypeError,
        6,
        18,
        "slice [4:2] is empty (its end must come after its start)",
    ),
    (
        "slice-bound-not-constant",
        node("h = b[0:x]"),
        CellTypeError,
        6,
        20,
        "a slice bound must be a constant made of numbers and dims, but 'x' is an input",
    ),
    ("slice-bound-unknown-name", node("h = b[0:Q]"), CellTypeError, 6, 20, "unknown dim 'Q' in a slice bound"),
    (
        "slice-bound-not-integer",
        node("h = b[0:H/3]"),
        CellTypeError,
        6,
        20,
        "a slice bound must be an integer, but this is 2.66667",
    ),
    ("slicing-a-matrix", node("h = W[0:2]"), CellTypeError, 6, 16, "only vectors can be sliced, but W is [8, 4]"),
    ("softmax-of-a-matrix", node("h = softmax(U)"), CellTypeError, 6, 16, "softmax takes a vector, but U is [8, 8]"),
    (
        "softmax-of-a-scalar",
        node("h = b * softmax(3)"),
        CellTypeError,
        6,
        20,
        "softmax takes a vector, but 3 is a scalar",
    ),
    (
        "state-assigned-wrong-shape",
        node("h = x"),
        CellTypeError,
        6,
        16,
        "shape mismatch: state h[8] is assigned a value of shape [4]",
    ),
    (
        "state-assigned-a-scalar",
        node("h = 2 * H"),
        CellTypeError,
        6,
        16,
        "state h[8] is assigned a value of shape scalar",
    ),
    (
        "state-assigned-a-matrix",
        node("h = U + U"),
        CellTypeError,
        6,
        16,
        "state h[8] is assigned a value of shape [8, 8]",
    ),
    (
        "output-shape",
        node("h = b", "    output y[X] = b + h"),
        CellTypeError,
        7,
        19,
        "shape mismatch: output y[4] is given a value of shape [8]",
    ),
    # ---- states in blocks ---------------------------------------------------------
    ("state-not-assigned-in-node", node("a = b"), CellTypeError, 6, 5, "state 'h' is not assigned in the node block"),
    (
        "state-not-assigned-in-leaf",
        cell("    leaf { a = b }", "    node { h = b }"),
        CellTypeError,
        6,
        5,
        "state 'h' is not assigned in the leaf block",
    ),
    (
        "state-assigned-twice",
        node("h = b; h = b"),
        CellTypeError,
        6,
        19,
        "state 'h' is assigned twice in the node block (first at line 6)",
    ),
    ("state-assigned-twice-in-one-statement", node("h, h = b, b"), CellTypeError, 6, 15, "state 'h' is assigned twice"),
    (
        "state-read-before-assigned",
        node("h = tanh(h)"),
        CellTypeError,
        6,
        21,
        "state 'h' is read before it is assigned in the node block (the children's h is child.h)",
    ),
    (
        "state-read-before-assigned-in-leaf",
        cell("    leaf { h = b + h }", "    node { h = b }"),
        CellTypeError,
        6,
        20,
        "state 'h' is read before it is assigned in the leaf block",
    ),
    (
        "local-read-before-assigned",
        node("a = c; c = b; h = a"),
        CellTypeError,
        6,
        16,
        "'c' is read before it is assigned in the node block",
    ),
    (
        "per-child-value-to-state",
        node("h = U @ child.h"),
        CellTypeError,
        6,
        16,
        "state 'h' is assigned a per-child value: reduce it over the children with sum(...), mean(...) or max(...)",
    ),
    (
        "per-child-local-to-state",
        node("a = child.h * 2; h = tanh(a + b)"),
        CellTypeError,
        6,
        33,
        "state 'h' is assigned a per-child value",
    ),
    # ---- children ----------------------------------------------------------------
    (
        "child-k-out-of-arity",
        node("h = child[2].h", on=ARITY2),
        CellTypeError,
        6,
        22,
        "child[2].h is out of the declared arity 2 (children are numbered 0 to 1)",
    ),
    (
        "child-k-negative",
        node("h = child[-1].h", on=ARITY2),
        CellTypeError,
        6,
        22,
        "child[-1].h is out of the declared arity 2",
    ),
    (
        "child-k-out-of-chain",
        node("h = child[1].h", on="tree(arity = 1)"),
        CellTypeError,
        6,
        22,
        "out of the declared arity 1",
    ),
    (
        "child-k-not-an-integer",
        node("h = child[0.5].h", on=ARITY2),
        CellTypeError,
        6,
        22,
        "a child number must be an integer, but this is 0.5",
    ),
    (
        "child-index-is-an-input",
        node("h = child[x].h", on=ARITY2),
        CellTypeError,
        6,
        22,
        "a child number must be a constant made of numbers and dims, but 'x' is an input",
    ),
    (
        "child-k-without-arity",
        node("h = child[0].h"),
        CellTypeError,
        6,
        16,
        "child[0].h needs a cell with an arity, e.g. 'on tree(arity = 2)'; use child.h for every child",
    ),
    ("child-k-without-arity-dag", node("h = child[0].h", on="dag"), CellTypeError, 6, 16, "needs a cell with an arity"),
    (
        "child-read-in-leaf",
        cell("    leaf { h = b + child[0].h }", "    node { h = b }", on=ARITY2),
        CellTypeError,
        6,
        20,
        "child[0].h in a leaf block: leaves have no children",
    ),
    (
        "child-all-in-leaf",
        cell("    leaf { h = tanh(child.h) }", "    node { h = b }"),
        CellTypeError,
        6,
        21,
        "child.h in a leaf block: leaves have no children",
    ),
    (
        "reduction-in-leaf",
        cell("    leaf { h = b * sum(1) }", "    node { h = b }"),
        CellTypeError,
        6,
        20,
        "sum(...) in a leaf block: leaves have no children",
    ),
    (
        "child-read-in-output",
        node("h = b", "    output y[H] = child[1].h", on=ARITY2),
        CellTypeError,
        7,
        19,
        "child[1].h in an output: outputs are computed from the node alone, without children",
    ),
    ("reduction-in-output", node("h = b", "    output y[H] = max(h)"), CellTypeError, 7, 19, "max(...) in an output"),
    (
        "arity-zero",
        prog("cell C on tree(arity = 0) {", "    state h[1]", "    node { h = h }", "}"),
        CellTypeError,
        1,
        24,
        "arity must be a positive integer, not 0",
    ),
    # ---- declarations ------------------------------------------------------------
    (
        "duplicate-same-kind",
        node("h = b", decls=(*DECLS[:2], "    param W[H, X], U[H, H], b[H], b[X]", DECLS[3])),
        CellTypeError,
        4,
        35,
        "duplicate declaration of 'b' (already declared as a param at line 4)",
    ),
    (
        "duplicate-across-kinds",
        node("h = b", decls=(*DECLS[:3], "    state h[H], x[X]")),
        CellTypeError,
        5,
        17,
        "duplicate declaration of 'x' (already declared as an input at line 3)",
    ),
    (
        "duplicate-dim",
        node("h = b", decls=("    dim X = 4, H = 8, X = 5", *DECLS[1:])),
        CellTypeError,
        2,
        23,
        "duplicate declaration of 'X' (already declared as a dim at line 2)",
    ),
    (
        "output-named-like-a-state",
        node("h = b", "    output h[H] = b"),
        CellTypeError,
        7,
        12,
        "duplicate declaration of 'h' (already declared as a state at line 5)",
    ),
    (
        "duplicate-cell",
        node("h = b") + prog("cell C on dag {", "    state s[1]", "    node { s = s }", "}"),
        CellTypeError,
        8,
        6,
        "duplicate cell 'C' (first defined at line 1)",
    ),
    (
        "duplicate-node-block",
        cell("    node { h = b }", "    node { h = b }"),
        CellTypeError,
        7,
        5,
        "duplicate node block (first at line 6)",
    ),
    (
        "duplicate-leaf-block",
        cell("    leaf { h = b }", "    leaf { h = b }", "    node { h = b }"),
        CellTypeError,
        7,
        5,
        "duplicate leaf block (first at line 6)",
    ),
    (
        "missing-node-block",
        cell("    leaf { h = b }"),
        CellTypeError,
        1,
        6,
        "cell 'C' has no node block (it is required)",
    ),
    (
        "declaration-after-block",
        node("h = b", "    param c[H]"),
        CellTypeError,
        7,
        11,
        "declaration of 'c' after a block: declarations come before the blocks",
    ),
    (
        "block-after-output",
        node("h = b", "    output y[H] = h", "    leaf { h = b }"),
        CellTypeError,
        8,
        5,
        "the leaf block must come before the outputs",
    ),
    (
        "cell-without-state",
        prog("cell C on tree {", "    dim H = 8", "    node { a = H }", "}"),
        CellTypeError,
        1,
        6,
        "cell 'C' declares no state: it would compute nothing",
    ),
    ("empty-file", "", CellTypeError, 1, 1, "the file defines no cell"),
    ("only-comments", prog("# nothing here", "   # at all"), CellTypeError, 1, 1, "the file defines no cell"),
    # ---- read-only names, targets vs values ------------------------------------------
    (
        "reassigned-input",
        node("x = x * 2; h = b"),
        CellTypeError,
        6,
        12,
        "cannot assign to input 'x': inputs are read-only",
    ),
    (
        "reassigned-param",
        node("h = b; b = h"),
        CellTypeError,
        6,
        19,
        "cannot assign to param 'b': params are read-only",
    ),
    ("reassigned-dim", node("H = 2; h = b"), CellTypeError, 6, 12, "cannot assign to dim 'H': dims are read-only"),
    ("reassigned-param-in-tuple", node("h, W = b, U"), CellTypeError, 6, 15, "cannot assign to param 'W'"),
    (
        "more-targets-than-values",
        node("h, a = b"),
        CellTypeError,
        6,
        17,
        "2 names on the left but 1 values on the right",
    ),
    (
        "more-values-than-targets",
        node("h = b, b"),
        CellTypeError,
        6,
        14,
        "1 names on the left but 2 values on the right",
    ),
    # ---- inits -------------------------------------------------------------------
    (
        "unknown-init",
        node("h = b", decls=(*DECLS[:2], "    param W[H, X] init xavir, U[H, H], b[H]", DECLS[3])),
        CellTypeError,
        4,
        24,
        "unknown init 'xavir' (expected zeros, ones, xavier, uniform(a, b) or normal(mean, std)) "
        "(did you mean 'xavier'?)",
    ),
    (
        "init-arg-count",
        node("h = b", decls=(*DECLS[:2], "    param W[H, X] init normal(0), U[H, H], b[H]", DECLS[3])),
        CellTypeError,
        4,
        24,
        "init normal takes 2 numbers, got 1",
    ),
    (
        "init-args-on-xavier",
        node("h = b", decls=(*DECLS[:2], "    param W[H, X] init xavier(1), U[H, H], b[H]", DECLS[3])),
        CellTypeError,
        4,
        24,
        "init xavier takes 0 numbers, got 1",
    ),
    (
        "uniform-a-equals-b",
        node("h = b", decls=(*DECLS[:2], "    param W[H, X], U[H, H], b[H] init uniform(0.1, 0.1)", DECLS[3])),
        CellTypeError,
        4,
        39,
        "uniform(a, b) needs a < b, got uniform(0.1, 0.1)",
    ),
    (
        "uniform-a-above-b",
        node("h = b", decls=(*DECLS[:2], "    param W[H, X], U[H, H] init uniform(1, -1), b[H]", DECLS[3])),
        CellTypeError,
        4,
        33,
        "uniform(a, b) needs a < b, got uniform(1, -1)",
    ),
    (
        "normal-negative-std",
        node("h = b", decls=(*DECLS[:2], "    param W[H, X] init normal(0, -0.5), U[H, H], b[H]", DECLS[3])),
        CellTypeError,
        4,
        24,
        "normal(mean, std) needs std >= 0, got -0.5",
    ),
    # ---- index inputs and look-ups --------------------------------------------------
    (
        "index-input-in-arithmetic",
        node("h = E[w] + w", decls=INDEX_DECLS),
        CellTypeError,
        6,
        23,
        "'w' is an index input: it can only select a row of a param, as E[w]",
    ),
    (
        "index-input-in-function",
        node("h = E[w] * sigmoid(w)", decls=INDEX_DECLS),
        CellTypeError,
        6,
        31,
        "'w' is an index input",
    ),
    (
        "index-input-to-state",
        node("h = w", decls=INDEX_DECLS),
        CellTypeError,
        6,
        16,
        "state h[8] is assigned a value of shape index (an int)",
    ),
    (
        "lookup-in-a-param-vector",
        node("h = b[w]", decls=INDEX_DECLS),
        CellTypeError,
        6,
        16,
        "b[w]: only a param matrix can be indexed by an index input (E[word])",
    ),
    (
        "lookup-in-a-computed-matrix",
        node("h = (E + E)[w]", decls=INDEX_DECLS),
        CellTypeError,
        6,
        17,
        "(E + E)[w]: only a param matrix can be indexed",
    ),
    (
        "lookup-with-a-float-input",
        node("h = E[x]", decls=INDEX_DECLS),
        CellTypeError,
        6,
        18,
        "E[x]: the row must be an index input (declared 'input w : index[V]')",
    ),
    (
        "lookup-with-a-number",
        node("h = E[0]", decls=INDEX_DECLS),
        CellTypeError,
        6,
        18,
        "E[0]: the row must be an index input",
    ),
    (
        "lookup-table-too-small",
        node("h = F[w]", decls=INDEX_DECLS),
        CellTypeError,
        6,
        17,
        "F[w]: F has 4 rows but w ranges over [0, 10)",
    ),
    (
        "index-range-zero",
        node("h = b", decls=(*DECLS[:2], "    input w : index[H - 8]", *DECLS[2:])),
        CellTypeError,
        4,
        21,
        "an index range must be positive, not 0",
    ),
    # ---- dims and sizes --------------------------------------------------------------
    (
        "dim-not-an-integer",
        node("h = b", decls=("    dim X = 2.5, H = 8", *DECLS[1:])),
        CellTypeError,
        2,
        13,
        "dim X must be a positive integer, not 2.5",
    ),
    (
        "dim-in-exponent-notation",
        node("h = b", decls=("    dim X = 4, H = 1e1", *DECLS[1:])),
        CellTypeError,
        2,
        20,
        "dim H must be a positive integer, not 1e1",
    ),
    (
        "dim-zero",
        node("h = b", decls=("    dim X = 0, H = 8", *DECLS[1:])),
        CellTypeError,
        2,
        13,
        "dim X must be a positive integer, not 0",
    ),
    (
        "size-zero",
        node("h = b", decls=(*DECLS[:3], "    state h[H], c[0]")),
        CellTypeError,
        5,
        19,
        "sizes must be positive, but this one is 0",
    ),
    (
        "size-zero-expression",
        node("h = b", decls=(*DECLS[:3], "    state h[H], c[2*X - H]")),
        CellTypeError,
        5,
        19,
        "sizes must be positive, but this one is 0",
    ),
    (
        "size-huge-literal",
        node("h = b", decls=(*DECLS[:3], "    state h[H], c[1e400]")),
        CellTypeError,
        5,
        19,
        "a size must be an integer, but this is inf",
    ),
    (
        "size-not-integer",
        node("h = b", decls=(*DECLS[:3], "    state h[H], c[1.5]")),
        CellTypeError,
        5,
        19,
        "a size must be an integer, but this is 1.5",
    ),
    (
        "three-sizes",
        node("h = b", decls=(*DECLS[:3], "    state h[H, H, H]")),
        CellTypeError,
        5,
        11,
        "state h must be a vector or a matrix (1 or 2 sizes), not 3 sizes",
    ),
    (
        "matrix-input",
        node("h = b", decls=(DECLS[0], "    input x[X, X]", *DECLS[2:])),
        CellTypeError,
        3,
        11,
        "input x must be a vector, not a matrix",
    ),
]


@pytest.mark.parametrize(
    ("source", "cls", "line", "col", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_error(source, cls, line, col, fragment):
    check(source, cls, line, col, fragment)


def test_case_ids_are_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


# ---- -D overrides ----------------------------------------------------------------------


def test_define_unknown_dim_is_a_dim_error():
    err = lower_error(node("h = b"), {"Q": 3})
    assert type(err) is DimError
    assert err.loc is None
    assert err.message == "dim override Q=3: no cell in t.cell declares a dim 'Q'"
    assert str(err) == "error: dim override Q=3: no cell in t.cell declares a dim 'Q'"


def test_cortexc_load_words_an_unknown_dim_as_an_override_not_as_the_clis_flag(tmp_path):
    """`cortexc.load(path, Q=3)` and `cortexc compile -D Q=3` share one message, in neither's syntax."""
    import cortexc

    path = tmp_path / "t.cell"
    path.write_text("cell T on tree {\n    state h[2]\n    node { h = sum(child.h) }\n}\n")
    with pytest.raises(DimError) as info:
        cortexc.load(path, out_dir=tmp_path / "out", Q=3)
    assert info.value.message == f"dim override Q=3: no cell in {path} declares a dim 'Q'"


def test_define_unknown_dim_did_you_mean():
    err = lower_error(node("h = b"), {"HH": 3})
    assert type(err) is DimError
    assert "(did you mean 'H'?)" in err.message


@pytest.mark.parametrize("value", [0, -4, 2.5, "16", True])
def test_define_bad_value_is_a_dim_error(value):
    err = lower_error(node("h = b"), {"H": value})
    assert type(err) is DimError
    assert err.loc is None
    assert "a dim must be a positive integer" in err.message
    assert err.others == []  # the dim keeps its default: no shape error follows from the bad value


def test_define_comes_first_among_several_errors():
    err = lower_error(node("h = b", decls=("    dim X = 4, H = 8, X = 1", *DECLS[1:])), {"Q": 1})
    assert [type(e) for e in err.all_errors] == [DimError, CellTypeError]


def test_define_override_changes_the_shapes_that_are_checked():
    src = node("c = b[0:6]; h = b")
    assert lower_source(src, "t.cell")  # valid with H = 8
    err = lower_error(src, {"H": 4})
    assert type(err) is CellTypeError
    assert (err.loc.line, err.loc.col) == (6, 20)
    assert "b[0:6]: slice [0:6] is out of range for a vector of 4" in err.message


# ---- several errors, order, rendering ----------------------------------------------------


def test_several_errors_in_one_block_are_all_reported():
    err = lower_error(node("a = W @ b; c = sigmod(b); h = b + x"))
    found = [(type(e), e.loc.line, e.loc.col) for e in err.all_errors]
    assert found == [(CellTypeError, 6, 18), (CellTypeError, 6, 27), (CellTypeError, 6, 44)]
    assert "unknown function 'sigmod'" in err.others[0].message
    text = str(err)
    assert text.count("t.cell:6:") == 3
    assert text.count("error:") == 3


def test_errors_are_reported_in_source_order():
    # the node block is checked before the leaf block, but the leaf block comes first in the file
    src = cell("    leaf { h = b + child.h }", "    node { h = sigmod(b) }", "    output y[H] = sum(h)")
    err = lower_error(src)
    locs = [(e.loc.line, e.loc.col) for e in err.all_errors]
    assert locs == [(6, 20), (7, 16), (8, 19)]
    assert "in a leaf block" in err.message


def test_declaration_errors_are_all_reported():
    src = node(
        "h = b",
        decls=("    dim X = 0, H = 8", "    input x[Y]", "    param W[H, X] init glorot, b[H]", "    state h[H], h[X]"),
    )
    err = lower_error(src)
    found = [(e.loc.line, e.loc.col, e.message.split(" ")[0]) for e in err.all_errors]
    assert found == [(2, 13, "dim"), (3, 13, "unknown"), (4, 24, "unknown"), (5, 17, "duplicate")]


def test_one_wrong_name_gives_one_error():
    # the statement in error makes its target unknown; later reads must not pile up errors
    err = lower_error(node("a = W @ y; c = a + 1; h = tanh(c * 2)"))
    assert err.others == []
    assert err.message.startswith("unknown name 'y'")


def test_wrong_target_count_gives_one_error():
    err = lower_error(node("h, a = b; c = a"))
    assert err.others == []


def test_syntax_error_rendering():
    err = lower_error(node("h = b $ b"))
    assert str(err) == ("t.cell:6:18: error: unexpected character '$'\n    node { h = b $ b }\n                 ^")


def test_type_error_rendering():
    err = lower_error(node("h = W @ b"))
    assert str(err) == (
        "t.cell:6:18: error: shape mismatch: W @ b multiplies W[8, 4] by b[8]: "
        "[8, 4] by [8]: inner dimensions 4 and 8 differ\n"
        "    node { h = W @ b }\n"
        "                 ^"
    )


def test_rendering_keeps_tabs_so_the_caret_lines_up():
    src = prog(
        "cell C on tree {",
        "\tdim H = 8",
        "\tparam W[H, H], b[4]",
        "\tstate h[H]",
        "\tnode {",
        "\t\th =\tW @ b",
        "\t}",
        "}",
    )
    err = lower_error(src)
    assert (err.loc.line, err.loc.col) == (6, 9)  # a tab is one column
    assert str(err).splitlines() == [
        "t.cell:6:9: error: shape mismatch: W @ b multiplies W[8, 8] by b[4]: "
        "[8, 8] by [4]: inner dimensions 8 and 4 differ",
        "\t\th =\tW @ b",
        "\t\t   \t  ^",
    ]


def test_rendering_of_end_of_file():
    err = lower_error("cell C on tree {\n    state h[1]\n")
    assert str(err) == ("t.cell:2:15: error: unexpected end of file, expected '}'\n    state h[1]\n              ^")


def test_rendering_with_crlf_line_endings():
    err = lower_error(node("h = b $ b").replace("\n", "\r\n"))
    assert (err.loc.line, err.loc.col) == (6, 18)
    assert str(err).splitlines()[1:] == ["    node { h = b $ b }", "                 ^"]


def test_every_error_is_a_cell_error_subclass():
    for cls in (CellSyntaxError, CellTypeError, DimError):
        assert issubclass(cls, CellError)


def test_cortexc_load_refuses_a_dim_too_long_to_print(tmp_path):
    """An int of 5001 digits through the Python API: the typed error `-D` gives, not Python's ValueError."""
    import cortexc

    with pytest.raises(DimError, match=r"dim override H=<an integer of about 5000 digits>: a dim must be at most"):
        cortexc.load(EXAMPLES / "lstm.cell", tmp_path, H=10**5000)
    with pytest.raises(DimError, match="a dim must be a positive integer"):
        cortexc.load(EXAMPLES / "lstm.cell", tmp_path, H="64")
