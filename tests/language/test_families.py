"""Families of matrices (language Version 3): 3-D params `W[R, M, K]`, read as `W[i]` (matrix `i`, `i` an index
input) and `W @ v` (the `[R, M]` matrix of all `R` products). The RNTN's bilinear form `(T @ hc) @ hc` and an
MV-RNN whose words each own a matrix, forward and backward on the interpreter, the compiled C and the emulated
CUDA against per-node float64 PyTorch written here (random trees with shuffled ids, SST trees, single nodes,
`Forest.concat`); sparse table gradients; `nn.Parameter`s; the inits; and the located errors."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.errors import CellTypeError, ForestError, InputError
from cortexc.frontend import lower_source
from tests.helpers import (
    EXAMPLES,
    assert_packages_compile_with_nvcc_without_spills,
    relative_error,
    shuffled_ids,
    sst_path,
)

torch = pytest.importorskip("torch")

DEVICES = ["interp", "cpu", "cuda-emu"]
H, V, C = 6, 40, 3

#: words own a matrix (`A[word]`, a family looked up per node) besides their vector; the composition reads
#: the children's matrices (Socher et al. 2012, with the matrices of the words a 3-D param)
MVRNN_WORDS = """
cell MVWords on tree(arity = 2) {
    dim H = 6, V = 40
    input word : index[V], mword : index[V]
    param E[V, H], A[V, H, H] init normal(0, 0.3), W[H, 2*H], W_M[H, 2*H], b[H]
    state h[H], M[H, H]
    leaf { h = tanh(E[word]); M = A[mword] }
    node {
        h = tanh(W @ concat(child[1].M @ child[0].h, child[0].M @ child[1].h) + b)
        M = W_M @ concat(child[0].M, child[1].M) + A[mword]
    }
}
"""


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    out = tmp_path_factory.mktemp("families")
    path = out / "mvwords.cell"
    path.write_text(MVRNN_WORDS, encoding="utf-8")
    return {
        "rntn": cortexc.load(EXAMPLES / "rntn.cell", out_dir=out / "rntn", V=V, H=H, C=C),
        "mvwords": cortexc.load(path, out_dir=out / "mvwords"),
    }


def _forests(seed: int) -> dict[str, Forest]:
    rng = np.random.default_rng(seed)
    shuffled = Forest.random(6, rng=rng, binary=True, max_nodes=15)
    return {
        "shuffled": shuffled_ids(shuffled, rng),
        "single": Forest.from_parents([-1]),
        "concat": Forest.concat([Forest.from_parents([-1]), Forest.random(3, rng=rng, binary=True, max_nodes=9)]),
    }


def _torch(params) -> dict:
    return {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in params.items()}


def _rntn_reference(forest: Forest, p: dict, word: np.ndarray) -> dict:
    """The RNTN per node, children first: h = tanh(hc' T[r] hc + W hc + b), hc = [h_left; h_right]."""
    h: dict[int, torch.Tensor] = {}
    for node in forest.level_order:
        kids = forest.children(int(node))
        if len(kids) == 0:
            h[int(node)] = torch.tanh(p["L"][int(word[node])])
            continue
        hc = torch.cat([h[int(kids[0])], h[int(kids[1])]])
        bilinear = torch.einsum("i,rij,j->r", hc, p["T"], hc)
        h[int(node)] = torch.tanh(bilinear + p["W"] @ hc + p["b"])
    states = torch.stack([h[i] for i in range(forest.num_nodes)])
    return {"h": states, "logits": states @ p["W_s"].T + p["b_s"]}


def _mvwords_reference(forest: Forest, p: dict, word: np.ndarray, mword: np.ndarray) -> dict:
    h: dict[int, torch.Tensor] = {}
    m: dict[int, torch.Tensor] = {}
    for node in (int(n) for n in forest.level_order):
        kids = [int(k) for k in forest.children(node)]
        own = p["A"][int(mword[node])]
        if not kids:
            h[node], m[node] = torch.tanh(p["E"][int(word[node])]), own
            continue
        (left, right) = kids
        mixed = torch.cat([m[right] @ h[left], m[left] @ h[right]])
        h[node] = torch.tanh(p["W"] @ mixed + p["b"])
        m[node] = p["W_M"] @ torch.cat([m[left], m[right]]) + own
    order = range(forest.num_nodes)
    return {"h": torch.stack([h[i] for i in order]), "M": torch.stack([m[i] for i in order])}


def _check(model, forest: Forest, reference, inputs: dict, rng: np.random.Generator, what: str) -> None:
    """Forward and every param gradient of `model` against the per-node float64 reference."""
    params = _torch(model.params)
    expected = reference(forest, params, *inputs.values())
    out = model(forest, grad=True, **inputs)
    for name, value in expected.items():
        assert relative_error(out[name], value.detach().numpy()) < 1e-5, f"{what}: {name}"
    upstream = {name: rng.standard_normal(value.shape) for name, value in expected.items()}
    loss = sum((value * torch.tensor(upstream[name])).sum() for name, value in expected.items())
    loss.backward()
    grads = model.backward(out, {k: v.astype(np.float32) for k, v in upstream.items()})
    for name, param in params.items():
        assert grads[name].shape == param.shape
        expected_grad = np.zeros(param.shape) if param.grad is None else param.grad.numpy()  # unused: 0
        assert relative_error(grads[name], expected_grad) < 1e-5, f"{what}: d{name}"


def _model(module, name: str, device: str, seed: int):
    model = getattr(module, name)(device=device, seed=seed)
    jitter = np.random.default_rng(seed)
    model.load_params(
        {k: v + 0.2 * jitter.standard_normal(v.shape).astype(np.float32) for k, v in model.params.items()}
    )
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["shuffled", "single", "concat"])
def test_rntn_bilinear_form_matches_per_node_torch(modules, device, kind):
    seed = int(np.random.SeedSequence().entropy % 2**31)  # fresh every run; printed on failure
    model = _model(modules["rntn"], "RNTN", device, seed)
    forest = _forests(seed)[kind]
    word = np.random.default_rng(seed).integers(0, V, forest.num_nodes).astype(np.int32)
    _check(model, forest, _rntn_reference, {"word": word}, np.random.default_rng(seed), f"{device} seed {seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_rntn_on_sst_trees(modules, device):
    lines = [line for line in sst_path("dev").read_text(encoding="utf-8").splitlines() if line.strip()]
    forest = Forest.from_ptb(lines[:25])
    rng = np.random.default_rng(7)
    word = rng.integers(0, V, forest.num_nodes).astype(np.int32)
    _check(_model(modules["rntn"], "RNTN", device, 3), forest, _rntn_reference, {"word": word}, rng, "SST")


@pytest.mark.parametrize("device", DEVICES)
def test_matrices_looked_up_per_word_match_per_node_torch(modules, device):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    model = _model(modules["mvwords"], "MVWords", device, seed)
    rng = np.random.default_rng(seed)
    forest = _forests(seed)["shuffled"]
    inputs = {name: rng.integers(0, V, forest.num_nodes).astype(np.int32) for name in ("word", "mword")}
    _check(model, forest, _mvwords_reference, inputs, rng, f"{device} seed {seed}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_family_looked_up_alone_has_a_sparse_gradient_of_whole_matrices(modules, device, rng):
    model = _model(modules["mvwords"], "MVWords", device, 4)
    forest = Forest.random(5, rng=rng, binary=True, max_nodes=11)
    inputs = {name: rng.integers(0, 12, forest.num_nodes).astype(np.int32) for name in ("word", "mword")}
    upstream = {"h": rng.standard_normal((forest.num_nodes, H)).astype(np.float32)}
    dense = model.backward(model(forest, grad=True, **inputs), upstream)["A"]
    sparse = model.backward(model(forest, grad=True, **inputs), upstream, sparse=True)["A"]
    assert sparse.shape == (V, H, H) and sparse.values.shape == (len(sparse.rows), H, H)
    assert list(sparse.rows) == sorted(set(inputs["mword"].tolist()))
    assert np.array_equal(sparse.to_dense(), dense)


def test_families_are_initialised_matrix_by_matrix_and_loaded_by_their_shape(modules, tmp_path):
    model = modules["rntn"].RNTN(device="cpu", seed=0)
    t = model.params["T"]
    assert t.shape == (H, 2 * H, 2 * H) and t.dtype == np.float32
    assert 0.005 < t.std() < 0.02  # init normal(0, 0.01)
    w = modules["mvwords"].MVWords(device="cpu", seed=0).params["W_M"]
    assert np.abs(w).max() <= np.sqrt(6 / (H + 2 * H))
    xavier = cortexc.compile_source(
        "cell X on tree {\n dim H = 4\n input i : index[3]\n param U[3, H, 8]\n state h[H]\n"
        " node { h = tanh(U[i] @ concat(sum(child.h), sum(child.h))) }\n}\n"
    )[0]
    drawn = cortexc.init_params(xavier, seed=1)["U"]
    bound = np.sqrt(6 / (4 + 8))  # each U[r] as a [4, 8] matrix: fan_out 4, fan_in 8
    assert drawn.shape == (3, 4, 8) and np.abs(drawn).max() <= bound and np.abs(drawn).max() > 0.8 * bound
    with pytest.raises(InputError, match=r"param T must have shape \(6, 12, 12\)"):
        model.load_params({"T": t.reshape(H * 2 * H, 2 * H)})
    saved = tmp_path / "params.npz"
    model.save_params(saved)
    again = modules["rntn"].RNTN(device="cpu", seed=9)
    again.load_params(saved)
    assert np.array_equal(again.params["T"], t)


def test_families_are_torch_parameters_with_their_gradient(modules):
    from cortexc.torch import CellModule, ForestBatch

    module = CellModule(modules["rntn"].RNTN, seed=2)
    assert tuple(dict(module.named_parameters())["T"].shape) == (H, 2 * H, 2 * H)
    rng = np.random.default_rng(5)
    forest = Forest.random(4, rng=rng, binary=True, max_nodes=9)
    word = rng.integers(0, V, forest.num_nodes).astype(np.int32)
    out = module(ForestBatch.from_forest(forest), word=torch.tensor(word))
    out["logits"].square().sum().backward()
    params = _torch({k: v.detach().numpy() for k, v in module.named_parameters()})
    expected = _rntn_reference(forest, params, word)["logits"].square().sum()
    expected.backward()
    assert relative_error(dict(module.named_parameters())["T"].grad.numpy(), params["T"].grad.numpy()) < 1e-5


ERRORS = [
    ("h = tanh(T + 1)", "'T' is a family of 3 matrices [4, 4]: use it as T[i]", "T + 1"),
    ("h = tanh(T[0:2] @ x)", "'T' is a family of 3 matrices", "T[0:2]"),
    ("h = tanh(T @ W)", "T @ W multiplies T[3, 4, 4] by W[4, 4]: a family of matrices multiplies a [4] vector", "@ W"),
    ("h = tanh(T[x] @ x)", "chosen by an index value", "x] @"),
    ("h = tanh(T[big] @ x)", "T has 3 matrices but big ranges over [0, 9)", "[big]"),
]


@pytest.mark.parametrize(("body", "message", "at"), ERRORS, ids=[e[0] for e in ERRORS])
def test_a_family_used_otherwise_is_a_located_error(body, message, at):
    source = (
        "cell E on tree {\n    dim H = 4, X = 4, R = 3\n    input x[X]\n    input w : index[R], big : index[9]\n"
        f"    param T[R, H, X], W[H, X]\n    state h[H]\n    node {{ {body} }}\n}}\n"
    )
    with pytest.raises(CellTypeError) as err:
        lower_source(source, "e.cell")
    text = str(err.value)
    assert message in text
    line = source.splitlines()[6]
    assert text.startswith(f"e.cell:7:{line.index(at) + 1}:"), text


@pytest.mark.parametrize("decl", ["state s[H, H, H]", "input y[H, H, H]", "output o[H, H, H] = h"])
def test_only_a_param_has_three_sizes(decl):
    where = "output" if decl.startswith("output") else "decl"
    source = "cell E on tree {\n    dim H = 4\n    state h[H]\n"
    body = "    node { h = tanh(sum(child.h)) }\n"
    source += (f"    {decl}\n" + body) if where == "decl" else (body + f"    {decl}\n")
    with pytest.raises(CellTypeError, match="only a param may have 3"):
        lower_source(source + "}\n", "e.cell")


@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
def test_saturated_families_agree_with_the_interpreter(modules, device):
    """Word vectors of +-100 and inf through the bilinear form: the same values (and NaNs) as the interpreter."""
    rng = np.random.default_rng(11)
    forest = Forest.random(4, rng=rng, binary=True, max_nodes=11)
    word = rng.integers(0, V, forest.num_nodes).astype(np.int32)
    params = dict(_model(modules["rntn"], "RNTN", "interp", 6).params)
    params["L"] = np.where(rng.random(params["L"].shape) < 0.5, 100.0, -100.0).astype(np.float32)
    params["L"][word[0], 0] = np.inf
    params["T"] = (params["T"] * 50).astype(np.float32)
    results = []
    for name in ("interp", device):
        model = modules["rntn"].RNTN(device=name)
        model.load_params(params)
        results.append(model(forest, word=word))
    for key, expected in results[0].items():
        np.testing.assert_allclose(results[1][key], expected, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=key)


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_family_cells_compile_with_nvcc_without_spills(modules):
    assert_packages_compile_with_nvcc_without_spills(modules.values())


# --------------------------------------------------------------------------- a matrix per child


#: a child's matrix chosen by its position (TBCNN-style) and by its edge's relation, both as one GEMM over
#: the family then a row per child (`select`); WIDE's relations (more than MAX_SELECTED_MATRICES) are looked
#: up per child instead
PER_CHILD = """
cell PerChild on tree {
    dim X = 4, H = 5, P = 4, R = 3, S = 20
    input x[X]
    input rel : index[R] on edge, wide : index[S] on edge
    param W[H, X], U[P, H, H], A[R, H, H], B[S, H, H], b[H]
    state h[H]
    node {
        h = tanh(W @ x + sum(U[edge.position] @ child.h) + sum(A[edge.rel] @ tanh(child.h))
                 + sum(B[edge.wide] @ child.h) * 0.5 + b)
    }
}
"""


def _per_child_reference(forest: Forest, p: dict, x, rel, wide) -> dict:
    hs = {}
    for node in (int(n) for n in forest.level_order):
        total = p["W"] @ x[node] + p["b"]
        start = int(forest.edge_ptr[node])
        for k, kid in enumerate(int(c) for c in forest.children(node)):
            e = start + k
            total = total + p["U"][k] @ hs[kid] + p["A"][int(rel[e])] @ torch.tanh(hs[kid])
            total = total + 0.5 * (p["B"][int(wide[e])] @ hs[kid])
        hs[node] = torch.tanh(total)
    return {"h": torch.stack([hs[i] for i in range(forest.num_nodes)])}


@pytest.fixture(scope="module")
def per_child(tmp_path_factory):
    out = tmp_path_factory.mktemp("per_child")
    path = out / "per_child.cell"
    path.write_text(PER_CHILD, encoding="utf-8")
    return cortexc.load(path, out_dir=out / "pkg")


@pytest.mark.parametrize("device", DEVICES)
def test_matrices_chosen_per_child_match_per_node_torch(per_child, device):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    model = _model(per_child, "PerChild", device, seed)
    rng = np.random.default_rng(seed)
    forest = Forest.concat([_forests(seed)["shuffled"], Forest.random(5, rng=rng, max_children=4, max_nodes=12)])
    inputs = {
        "x": rng.standard_normal((forest.num_nodes, 4)).astype(np.float32),
        "rel": rng.integers(0, 3, forest.num_edges).astype(np.int32),
        "wide": rng.integers(0, 20, forest.num_edges).astype(np.int32),
    }
    params = _torch(model.params)
    x = torch.tensor(inputs["x"], dtype=torch.float64, requires_grad=True)
    expected = _per_child_reference(forest, params, x, inputs["rel"], inputs["wide"])["h"]
    out = model(forest, grad=True, **inputs)
    assert relative_error(out["h"], expected.detach().numpy()) < 1e-5, f"seed {seed}"
    upstream = rng.standard_normal(expected.shape)
    (expected * torch.tensor(upstream)).sum().backward()
    grads = model.backward(out, {"h": upstream.astype(np.float32)})
    for name, leaf in {**params, "x": x}.items():
        assert relative_error(grads[name], leaf.grad.numpy()) < 1e-5, f"seed {seed}: d{name}"


def test_a_product_chosen_by_position_is_one_gemm_and_a_row_per_child():
    from cortexc.ir.ops import Op

    (cell,) = cortexc.compile_source(PER_CHILD, "per_child.cell")
    ops = [v.op for v in cell.node.values]
    assert ops.count(Op.SELECT) == 2  # position and rel; the 20 relations of `wide` are looked up per child
    assert ops.count(Op.EMBED) == 1


def test_a_node_with_more_children_than_positions_is_refused_by_name(per_child):
    model = per_child.PerChild(device="cpu")
    forest = Forest.from_parents([5, 5, 5, 5, 5, -1])
    inputs = {"x": np.zeros((6, 4), np.float32), "rel": np.zeros(5, np.int32), "wide": np.zeros(5, np.int32)}
    with pytest.raises(ForestError, match=r"node 5 has 5 children, but U\[edge.position\] of cell PerChild chooses"):
        model(forest, **inputs)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("h = tanh(sum(U[edge.position] @ child.h))", "U has 2 matrices but a child's position ranges over [0, 3)"),
        ("h = tanh(sum(U[edge.position]) @ x)", "U has 2 matrices but a child's position ranges over [0, 3)"),
    ],
)
def test_position_errors_are_located(body, message):
    source = (
        "cell E on tree(arity = 3) {\n    dim H = 4\n    input x[H]\n    param U[2, H, H]\n    state h[H]\n"
        f"    node {{ {body} }}\n}}\n"
    )
    with pytest.raises(CellTypeError) as err:
        lower_source(source, "e.cell")
    assert message in str(err.value) and str(err.value).startswith("e.cell:6:"), str(err.value)


# --------------------------------------------------------------------------- a matrix or row chosen by position
#: `U[edge.position]` as a matrix of its own (then multiplied) and `E[edge.position]`, a table's row, per child
#: of a bottom-up cell and per node of a down cell (the edge to the parent; U[0] / E[0] at a root)
BY_POSITION = {
    "up": """
cell ByPosition on tree {
    dim X = 3, H = 4
    input x[X]
    param W[H, X], U[4, H, H], E[4, H], b[H]
    state h[H]
    leaf { h = tanh(W @ x + b) }
    node {
        M = U[edge.position]
        h = tanh(W @ x + sum(M @ child.h) + sum(E[edge.position] * child.h))
    }
}
""",
    "down": """
cell ByPositionDown on tree down {
    dim X = 3, H = 4
    input x[X]
    param W[H, X], U[4, H, H], E[4, H], b[H]
    state h[H]
    root { h = tanh(W @ x + b) }
    node {
        M = U[edge.position]
        h = tanh(W @ x + M @ parent.h + E[edge.position] * parent.h)
    }
}
""",
}


@pytest.fixture(scope="module")
def by_position(tmp_path_factory):
    out = tmp_path_factory.mktemp("by_position")
    built = {}
    for name, text in BY_POSITION.items():
        path = out / f"{name}.cell"
        path.write_text(text, encoding="utf-8")
        built[name] = cortexc.load(path, out_dir=out / name)
    return built


def _by_position_reference(forest: Forest, p: dict, x, down: bool) -> torch.Tensor:
    """Per node in float64: child k (or, down, the node as its parent's child k) through U[k] and E[k]."""
    order: list[int] = []

    def visit(node: int) -> None:
        for child in forest.children(node):
            visit(int(child))
        order.append(node)

    for root in forest.roots:
        visit(int(root))
    hs: dict[int, torch.Tensor] = {}
    if not down:
        for node in order:
            kids = [int(c) for c in forest.children(node)]
            total = p["W"] @ x[node] + (p["b"] if not kids else 0)
            for k, child in enumerate(kids):
                total = total + p["U"][k] @ hs[child] + p["E"][k] * hs[child]
            hs[node] = torch.tanh(total)
    else:
        place = {
            int(c): (parent, k) for parent in range(forest.num_nodes) for k, c in enumerate(forest.children(parent))
        }
        for node in reversed(order):
            if node not in place:
                hs[node] = torch.tanh(p["W"] @ x[node] + p["b"])
                continue
            parent, k = place[node]
            hs[node] = torch.tanh(p["W"] @ x[node] + p["U"][k] @ hs[parent] + p["E"][k] * hs[parent])
    return torch.stack([hs[i] for i in range(forest.num_nodes)])


@pytest.mark.parametrize("device", ["interp", "cpu", "cuda-emu"])
@pytest.mark.parametrize("kind", ["up", "down"])
def test_a_matrix_or_row_chosen_by_position_matches_per_node_torch(by_position, kind, device):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    cls = getattr(by_position[kind], by_position[kind].__all__[0])
    trees = shuffled_ids(Forest.random(5, rng=rng, max_children=4, max_nodes=16), rng)
    for forest in (trees, Forest.from_parents([-1]), Forest.concat([Forest.from_parents([-1, 0, 0, 0]), trees])):
        model = cls(device=device, seed=int(rng.integers(1 << 30)))
        params = {k: (v + 0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in model.params.items()}
        model.load_params(params)
        x = rng.standard_normal((forest.num_nodes, 3)).astype(np.float32)
        out = model(forest, grad=True, x=x)
        upstream = rng.standard_normal(out["h"].shape).astype(np.float32)
        grads = model.backward(out, {"h": upstream})
        tp = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
        expected = _by_position_reference(forest, tp, torch.tensor(x, dtype=torch.float64), kind == "down")
        (expected * torch.tensor(upstream, dtype=torch.float64)).sum().backward()
        where = f"{kind} {device} seed={seed} nodes={forest.num_nodes}"
        assert relative_error(out["h"], expected.detach().numpy()) < 1e-5, where
        for name, tensor in tp.items():
            want = np.zeros(tensor.shape) if tensor.grad is None else tensor.grad.numpy()
            assert relative_error(grads[name], want) < 1e-4, f"{name} {where}"
    wide = Forest.from_parents([5, 5, 5, 5, 5, -1])  # 5 children, 4 matrices
    with pytest.raises(ForestError, match="node 5 has 5 children, but"):
        cls(device=device)(wide, x=np.zeros((6, 3), np.float32))


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cells_choosing_by_position_compile_with_nvcc_without_spills(by_position):
    assert_packages_compile_with_nvcc_without_spills(by_position.values())
