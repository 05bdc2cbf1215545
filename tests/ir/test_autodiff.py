"""Gradients (the `autodiff` pass run by `reference.backward`) against independent oracles.

Three kinds of oracle, none sharing code with the pass:

1. central finite differences in float64 of the scalar ``L = sum_k <g_k, y_k>`` over
   every state and output ``y_k`` with random upstream gradients ``g_k``, for every
   spec example and for cells written here to exercise every gradient rule;
2. ``torch.autograd`` through per-node PyTorch implementations of the models written
   from their math (Child-Sum and binary Tree-LSTM, chain LSTM, MV-RNN), in float32
   through the model API (``device="interp"``) and in float64 through `reference.backward`;
3. hand computations: a DAG against the same DAG unrolled into a tree, linear cells
   whose gradients are sums of upstream gradients along paths, missing children.

Errors are printed (``pytest -s``) as ``graderr[...]``.
"""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import reference
from cortexc.errors import CortexcError, InputError
from cortexc.ir.ops import LEAF_OPS, Domain, Op
from cortexc.pipeline import compile_file, compile_source
from cortexc.runtime.forest import Forest
from tests.helpers import EXAMPLES, children_of, random_graph, random_inputs, relative_error

FD_RTOL = 1e-6  # float64 finite differences, per coordinate
TORCH_RTOL = {np.float32: 1e-4, np.float64: 1e-9}  # normwise, per array


# ------------------------------------------------------------------ helpers


def example(name: str, **dims: int):
    return compile_file(EXAMPLES / name, dims)[0]


def inline(source: str, **dims: int):
    return compile_source(source, "inline.cell", dims or None)[0]


def rand_params(cell, rng, scale: float = 0.5) -> dict[str, np.ndarray]:
    """Every param random in float64 (biases too, unlike the declared inits)."""
    return {d.name: rng.normal(0.0, scale, d.shape) for d in cell.params}


def f64(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v for k, v in arrays.items()}


def f32(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v for k, v in arrays.items()}


def random_upstream(out: dict[str, np.ndarray], rng, names=None) -> dict[str, np.ndarray]:
    """A random gradient (float64) for every state and output, or for `names`."""
    return {k: rng.standard_normal(v.shape) for k, v in out.items() if names is None or k in names}


def objective(cell, forest, params, inputs, upstream) -> float:
    out = reference.run(cell, forest, params, inputs, np.float64)
    return float(sum(np.sum(out[k] * g) for k, g in upstream.items()))


def analytic(cell, forest, params, inputs, upstream, dtype=np.float64) -> dict[str, np.ndarray]:
    out = reference.run(cell, forest, params, inputs, dtype)
    states = {s.name: out[s.name] for s in cell.states}
    grads = reference.backward(cell, forest, params, inputs, states, upstream, dtype)
    expected = {p.name for p in cell.params} | {i.name for i in cell.inputs if not i.is_index and not i.given_by}
    assert set(grads) == expected, "backward must give every param and every float input, nothing else"
    return grads


def central_difference(cell, forest, params, inputs, upstream, where: str, name: str, idx, h: float) -> float:
    """dL/d(where[name][idx]) by the fourth-order central difference with step h."""
    arrays = params if where == "param" else inputs
    base = arrays[name]
    values = []
    for step in (-2, -1, 1, 2):
        moved = base.copy()
        moved[idx] += step * h
        arrays[name] = moved
        try:
            values.append(objective(cell, forest, params, inputs, upstream))
        finally:
            arrays[name] = base
    return (values[0] - 8 * values[1] + 8 * values[2] - values[3]) / (12 * h)


def fd_check(
    cell, forest, params, inputs, upstream, rng, what: str, coords: int = 12, focus: dict[str, np.ndarray] | None = None
) -> dict[str, float]:
    """Analytic gradients against finite differences on `coords` random coordinates of every
    param and float input; returns the worst relative error per array (and asserts it).

    The relative error of a coordinate is |analytic - fd| / max(|analytic|, |fd|, floor), the
    floor being the larger of 1e-4 of the array's largest analytic entry and 1e6 times the
    rounding noise of the difference quotient (~1e-16 sum |g y| / h), so that entries that are
    0 or tiny against the rest are judged absolutely. A coordinate is retried with a 10x and
    then a 100x smaller step if it fails, so that a perturbation crossing a kink (relu, abs, a max changing
    hands) is not taken for a wrong gradient. ``focus`` maps a param to rows to sample from
    (the rows of an embedding table that were looked up; one other row is sampled too).
    """
    params, inputs = dict(params), dict(inputs)
    grads = analytic(cell, forest, params, inputs, upstream)
    out = reference.run(cell, forest, params, inputs, np.float64)
    magnitude = float(sum(np.abs(out[k] * g).sum() for k, g in upstream.items()))
    worst: dict[str, float] = {}
    arrays = [("param", k, v) for k, v in params.items()]
    arrays += [("input", k, v) for k, v in inputs.items() if np.issubdtype(v.dtype, np.floating)]
    for where, name, array in arrays:
        if focus and name in focus:
            rows = np.unique(focus[name])
            unused = np.setdiff1d(np.arange(array.shape[0]), rows)
            picked = list(rng.choice(rows, size=min(coords, len(rows)), replace=False))
            if unused.size:
                picked.append(int(rng.choice(unused)))
            flat = [int(r) * array.shape[1] + int(rng.integers(array.shape[1])) for r in picked]
        else:
            flat = rng.choice(array.size, size=min(coords, array.size), replace=False)
        scale = float(np.abs(grads[name]).max())
        errors = []
        for f in flat:
            idx = np.unravel_index(int(f), array.shape)
            got = float(grads[name][idx])
            err = 0.0
            for h in (1e-3, 1e-4, 1e-5, 1e-6, 1e-7):  # smaller steps until none crosses a kink
                fd = central_difference(cell, forest, params, inputs, upstream, where, name, idx, h)
                floor = max(1e-4 * scale, 1e6 * 2e-16 * magnitude / h, 1e-300)
                err = abs(got - fd) / max(abs(got), abs(fd), floor)
                if err <= FD_RTOL:
                    break
            errors.append(err)
        worst[name] = max(errors)
    print(f"graderr[fd, {what}] max={max(worst.values()):.2e} " + " ".join(f"{k}={v:.1e}" for k, v in worst.items()))
    bad = {k: v for k, v in worst.items() if v > FD_RTOL}
    assert not bad, f"{what}: gradient differs from finite differences: {bad}"
    return worst


def fd_case(
    cell,
    forest,
    rng,
    what: str,
    scale: float = 0.5,
    coords: int = 12,
    upstream_names=None,
    focus_rows: dict[str, str] | None = None,
):
    """Random params, inputs and upstream gradients (outputs and states), then `fd_check`."""
    params = rand_params(cell, rng, scale)
    inputs = f64(random_inputs(cell, forest, rng))
    out = reference.run(cell, forest, params, inputs, np.float64)
    upstream = random_upstream(out, rng, upstream_names)
    focus = {table: inputs[index] for table, index in (focus_rows or {}).items()}
    return fd_check(cell, forest, params, inputs, upstream, rng, what, coords, focus)


def chain_parents(lengths) -> list[int]:
    """Chains for `tree(arity = 1)` cells: in each, node i's child is node i - 1 (sequence order)."""
    parents, offset = [], 0
    for n in lengths:
        parents += [offset + i + 1 for i in range(n - 1)] + [-1]
        offset += n
    return parents


def chains(lengths) -> Forest:
    return Forest.from_parents(chain_parents(lengths))


def own_random_dag(rng, n: int, max_children: int = 3) -> tuple[Forest, list[list[int]]]:
    """A DAG from our own generator (node i reads distinct earlier nodes, in a random order) and
    its children lists; regenerated until some node has two or more readers."""
    while True:
        kids = [[int(k) for k in rng.permutation(i)[: rng.integers(0, min(i, max_children) + 1)]] for i in range(n)]
        if np.bincount(sum(kids, []), minlength=n).max() >= 2:
            break
    ptr = np.cumsum([0] + [len(k) for k in kids])
    return Forest(ptr, np.array(sum(kids, []), np.int64)), kids


# ------------------------------------------- 1. every spec example vs finite differences


def example_forest(kind: str, rng) -> Forest:
    if kind == "tree":  # any number of children, single nodes, a chain
        return Forest.concat(
            [
                Forest.random(3, rng, max_children=4, max_nodes=12),
                Forest.from_parents([-1]),
                Forest.from_parents([1, 2, -1]),
            ]
        )
    if kind == "binary":
        return Forest.concat([Forest.random(3, rng, binary=True, max_nodes=11), Forest.from_parents([-1])])
    if kind == "dag":
        while True:
            dag = Forest.random_dag(16, rng, max_children=3, max_parents=3)
            if np.bincount(np.concatenate([dag.children(i) for i in range(16)]), minlength=16).max() >= 2:
                return dag  # some node is shared
    if kind == "chain":
        return chains([1, 4, 7])
    if kind == "graph":
        return random_graph(9, 8, rng)
    raise ValueError(kind)


EXAMPLE_CASES = {
    "treelstm.cell": ({"X": 4, "H": 3}, "tree"),
    "binary_treelstm.cell": ({"V": 6, "X": 4, "H": 3, "C": 5}, "binary"),
    "treernn.cell": ({"X": 4, "H": 3}, "binary"),
    "mvrnn.cell": ({"X": 4, "H": 3}, "binary"),
    "dagrnn.cell": ({"X": 4, "H": 3}, "dag"),
    "attn_treelstm.cell": ({"X": 4, "H": 3}, "tree"),
    "lstm.cell": ({"X": 4, "H": 3}, "chain"),
    "treelstm_dropout.cell": ({"V": 6, "X": 4, "H": 3, "C": 5}, "binary"),  # evaluation mode
    "sst_treelstm.cell": ({"V": 6, "X": 4, "H": 3, "C": 5}, "binary"),  # evaluation mode
    "rntn.cell": ({"V": 6, "H": 3, "C": 5}, "binary"),
    "tbcnn.cell": ({"X": 4, "H": 3}, "tree"),
    "ggnn.cell": ({"X": 4, "H": 3, "R": 2, "T": 2, "C": 2}, "graph"),
    "typed_daglstm.cell": ({"X": 4, "H": 3, "R": 2, "D": 2}, "dag"),
    "bitreelstm.cell": ({"V": 6, "X": 4, "H": 3, "C": 5}, "binary"),  # both cells (the second a down cell)
}


def test_every_example_is_covered():
    assert sorted(EXAMPLE_CASES) == sorted(p.name for p in EXAMPLES.glob("*.cell"))


@pytest.mark.parametrize("name", sorted(EXAMPLE_CASES))
def test_example_gradients_vs_finite_differences(name, rng):
    dims, kind = EXAMPLE_CASES[name]
    forest = example_forest(kind, rng)
    focus = {"E": "word"} if name == "binary_treelstm.cell" else None
    for cell in compile_file(EXAMPLES / name, dims):  # every cell of the file
        fd_case(cell, forest, rng, f"{name} {cell.name}", focus_rows=focus)


def test_binary_treelstm_upstream_on_outputs_only_or_states_only(rng):
    cell = example("binary_treelstm.cell", V=6, X=4, H=3, C=5)
    forest = example_forest("binary", rng)
    fd_case(cell, forest, rng, "binary_treelstm logits only", upstream_names={"logits"}, focus_rows={"E": "word"})
    fd_case(cell, forest, rng, "binary_treelstm c only", upstream_names={"c"}, focus_rows={"E": "word"})


# ----------------------------------------------- 2. against torch.autograd, per-node models


def torch_grads(torch, fn, params: dict, inputs: dict, upstream: dict, dtype):
    """Run `fn(params, inputs) -> {name: tensor}` in torch and return the forward and the gradients
    of sum <upstream, out> w.r.t. every param and float input (dense, like cortexc)."""
    tdtype = torch.float32 if dtype == np.float32 else torch.float64
    tp = {k: torch.tensor(np.asarray(v), dtype=tdtype, requires_grad=True) for k, v in params.items()}
    ti = {
        k: (
            torch.tensor(np.asarray(v), dtype=tdtype, requires_grad=True)
            if np.issubdtype(np.asarray(v).dtype, np.floating)
            else torch.tensor(np.asarray(v), dtype=torch.long)
        )
        for k, v in inputs.items()
    }
    out = fn(torch, tp, ti)
    loss = sum((out[k] * torch.tensor(g, dtype=tdtype)).sum() for k, g in upstream.items())
    loss.backward()
    grads = {k: t.grad.numpy() if t.grad is not None else np.zeros(t.shape) for k, t in tp.items()}
    grads.update(
        {k: t.grad.numpy() if t.grad is not None else np.zeros(t.shape) for k, t in ti.items() if t.is_floating_point()}
    )
    return {k: v.detach().numpy() for k, v in out.items()}, grads


def torch_childsum(children):
    def fn(torch, p, i):
        x = i["x"]
        H = p["U_f"].shape[0]
        h, c = [None] * len(children), [None] * len(children)
        for n in topo_order(children):
            kids = children[n]
            h_sum = sum((h[k] for k in kids), torch.zeros(H, dtype=x.dtype))
            iou = p["W_iou"] @ x[n] + p["U_iou"] @ h_sum + p["b_iou"]
            cell = torch.sigmoid(iou[:H]) * torch.tanh(iou[2 * H :])
            for k in kids:
                f = torch.sigmoid(p["W_f"] @ x[n] + p["U_f"] @ h[k] + p["b_f"])
                cell = cell + f * c[k]
            c[n] = cell
            h[n] = torch.sigmoid(iou[H : 2 * H]) * torch.tanh(cell)
        return {"h": torch.stack(h), "c": torch.stack(c)}

    return fn


def torch_binary_treelstm(children):
    def fn(torch, p, i):
        words = i["word"]
        H = p["U_f"].shape[0] // 2
        h, c = [None] * len(children), [None] * len(children)
        for n in topo_order(children):
            kids = children[n]
            if not kids:
                iou = p["W_iou"] @ p["E"][words[n]] + p["b_iou"]
                c[n] = torch.sigmoid(iou[:H]) * torch.tanh(iou[2 * H :])
            else:
                zero = torch.zeros(H, dtype=p["E"].dtype)
                h1, c1 = (h[kids[1]], c[kids[1]]) if len(kids) > 1 else (zero, zero)
                hc = torch.cat([h[kids[0]], h1])
                iou = p["U_iou"] @ hc + p["b_iou"]
                f = torch.sigmoid(p["U_f"] @ hc + p["b_f"])
                c[n] = torch.sigmoid(iou[:H]) * torch.tanh(iou[2 * H :]) + f[:H] * c[kids[0]] + f[H:] * c1
            h[n] = torch.sigmoid(iou[H : 2 * H]) * torch.tanh(c[n])
        hs = torch.stack(h)
        return {"h": hs, "c": torch.stack(c), "logits": hs @ p["W_s"].T + p["b_s"]}

    return fn


def torch_mvrnn(children):
    def fn(torch, p, i):
        x = i["x"]
        h, A = [None] * len(children), [None] * len(children)
        for n in topo_order(children):
            kids = children[n]
            if not kids:
                h[n] = torch.tanh(p["W_x"] @ x[n] + p["b"])
                A[n] = p["A0"]
            else:
                (l, r) = kids
                h[n] = torch.tanh(p["W"] @ torch.cat([A[r] @ h[l], A[l] @ h[r]]) + p["b"])
                A[n] = p["W_M"] @ torch.cat([A[l], A[r]], dim=0)
        return {"h": torch.stack(h), "A": torch.stack(A)}

    return fn


def torch_lstm_cells(children):
    """The chain LSTM one step at a time with torch.nn.LSTMCell (gate order i, f, g, o)."""

    def fn(torch, p, i):
        x = i["x"]
        X, H = x.shape[1], p["W_hh"].shape[1]
        step = torch.nn.LSTMCell(X, H).to(x.dtype)
        weights = {"weight_ih": p["W_ih"], "weight_hh": p["W_hh"], "bias_ih": p["b_ih"], "bias_hh": p["b_hh"]}
        h, c = [None] * len(children), [None] * len(children)
        for n in topo_order(children):
            kids = children[n]
            prev = (h[kids[0]][None], c[kids[0]][None]) if kids else None
            hn, cn = torch.func.functional_call(step, weights, (x[n][None], prev))
            h[n], c[n] = hn[0], cn[0]
        return {"h": torch.stack(h), "c": torch.stack(c)}

    return fn


def topo_order(children: list[list[int]]) -> list[int]:
    """Children before parents, computed here from the children lists (each node once)."""
    done: list[bool] = [False] * len(children)
    order: list[int] = []

    def visit(n):
        if not done[n]:
            for k in children[n]:
                visit(k)
            done[n] = True
            order.append(n)

    for n in range(len(children)):
        visit(n)
    return order


def own_tree_parents(rng, sizes, binary: bool) -> list[int]:
    """Random trees from our own generator: parents always have larger ids than children."""
    parents: list[int] = []
    for size in sizes:
        base = len(parents)
        if binary:
            pool = [base + k for k in range(size)]  # leaves
            local = [-1] * size
            nxt = base + size
            while len(pool) > 1:
                j = int(rng.integers(len(pool) - 1))
                local += [-1]
                local[pool[j] - base] = nxt - base
                local[pool[j + 1] - base] = nxt - base
                pool[j : j + 2] = [nxt]
                nxt += 1
            parents += [base + q if q >= 0 else -1 for q in local]
        else:
            parents += [base + int(rng.integers(k + 1, size)) for k in range(size - 1)] + [-1]
    return parents


TORCH_MODELS = {
    # name: (file, dims, parent-array maker, torch fn maker)
    "childsum": (
        "treelstm.cell",
        {"X": 5, "H": 4},
        lambda rng: own_tree_parents(rng, [1, 9, 14, 3], binary=False),
        torch_childsum,
    ),
    "binary": (
        "binary_treelstm.cell",
        {"V": 7, "X": 5, "H": 4, "C": 5},
        lambda rng: own_tree_parents(rng, [1, 6, 4, 9], binary=True),
        torch_binary_treelstm,
    ),
    "mvrnn": ("mvrnn.cell", {"X": 5, "H": 4}, lambda rng: own_tree_parents(rng, [1, 5, 8], binary=True), torch_mvrnn),
    "lstm": ("lstm.cell", {"X": 5, "H": 4}, lambda rng: chain_parents([1, 6, 11]), torch_lstm_cells),
}


@pytest.mark.parametrize("name", sorted(TORCH_MODELS))
def test_float64_gradients_vs_torch(name, rng):
    torch = pytest.importorskip("torch")
    path, dims, make_parents, make_fn = TORCH_MODELS[name]
    cell = example(path, **dims)
    parents = make_parents(rng)
    forest = Forest.from_parents(parents)
    params = rand_params(cell, rng)
    inputs = f64(random_inputs(cell, forest, rng))
    out = reference.run(cell, forest, params, inputs, np.float64)
    upstream = random_upstream(out, rng)
    ref_out, ref = torch_grads(torch, make_fn(children_of(parents)), params, inputs, upstream, np.float64)
    for k in ref_out:
        assert relative_error(out[k], ref_out[k]) <= TORCH_RTOL[np.float64], f"forward {k}"
    grads = analytic(cell, forest, params, inputs, upstream, np.float64)
    errors = {k: relative_error(grads[k], ref[k]) for k in grads}
    print(
        f"graderr[torch float64, {name}] max={max(errors.values()):.2e} "
        + " ".join(f"{k}={v:.1e}" for k, v in errors.items())
    )
    assert max(errors.values()) <= TORCH_RTOL[np.float64], errors


def load_model(path, dims, seed=0):
    """A model of the generated package with the reference interpreter (`cortexc.load`)."""
    module = cortexc.load(EXAMPLES / path, **dims)
    cell = example(path, **dims)
    return getattr(module, cell.name)(device="interp", seed=seed), cell


@pytest.mark.parametrize("name", sorted(TORCH_MODELS))
def test_float32_model_gradients_vs_torch(name, rng):
    torch = pytest.importorskip("torch")
    path, dims, make_parents, make_fn = TORCH_MODELS[name]
    model, cell = load_model(path, dims)
    parents = make_parents(rng)
    forest = Forest.from_parents(parents)
    params = f32(rand_params(cell, rng))
    inputs = random_inputs(cell, forest, rng)  # float32
    model.load_params(params)
    out = model(forest, grad=True, **inputs)
    upstream = f32(random_upstream(out, rng))
    grads = model.backward(out, upstream)
    ref_out, ref = torch_grads(torch, make_fn(children_of(parents)), params, inputs, upstream, np.float32)
    for k in ref_out:
        assert relative_error(out[k], ref_out[k]) <= TORCH_RTOL[np.float32], f"forward {k}"
    assert set(grads) == set(ref)
    errors = {}
    for k, g in grads.items():
        assert g.dtype == np.float32 and g.shape == ref[k].shape, k
        errors[k] = relative_error(g, ref[k])
    print(
        f"graderr[torch float32 model, {name}] max={max(errors.values()):.2e} "
        + " ".join(f"{k}={v:.1e}" for k, v in errors.items())
    )
    assert max(errors.values()) <= TORCH_RTOL[np.float32], errors


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lstm_gradients_vs_torch_nn_lstm(dtype, rng):
    """torch.nn.LSTM (the fused layer) with the same weights on a batch of equal-length chains:
    gradients of h at every step and of c at the last step (what nn.LSTM exposes)."""
    torch = pytest.importorskip("torch")
    X, H, T, B = 5, 4, 7, 3
    cell = example("lstm.cell", X=X, H=H)
    forest = chains([T] * B)  # chain b is nodes b*T .. b*T+T-1 in time order
    params = {k: v.astype(dtype) for k, v in rand_params(cell, rng).items()}
    x = rng.standard_normal((B * T, X)).astype(dtype)
    gh = rng.standard_normal((B * T, H)).astype(dtype)
    gc = np.zeros((B * T, H), dtype)
    gc[T - 1 :: T] = rng.standard_normal((B, H))
    tdtype = torch.float32 if dtype == np.float32 else torch.float64
    lstm = torch.nn.LSTM(X, H).to(tdtype)
    with torch.no_grad():
        for name, attr in (
            ("W_ih", "weight_ih_l0"),
            ("W_hh", "weight_hh_l0"),
            ("b_ih", "bias_ih_l0"),
            ("b_hh", "bias_hh_l0"),
        ):
            getattr(lstm, attr).copy_(torch.from_numpy(params[name]))
    tx = torch.tensor(x.reshape(B, T, X).transpose(1, 0, 2).copy(), requires_grad=True)  # [T, B, X]
    hs, (_, c_last) = lstm(tx)
    loss = (hs * torch.from_numpy(gh.reshape(B, T, H).transpose(1, 0, 2).copy())).sum()
    loss = loss + (c_last[0] * torch.from_numpy(gc[T - 1 :: T].copy())).sum()
    loss.backward()
    ref = {
        "W_ih": lstm.weight_ih_l0.grad,
        "W_hh": lstm.weight_hh_l0.grad,
        "b_ih": lstm.bias_ih_l0.grad,
        "b_hh": lstm.bias_hh_l0.grad,
    }
    ref = {k: v.numpy() for k, v in ref.items()}
    ref["x"] = tx.grad.numpy().transpose(1, 0, 2).reshape(B * T, X)
    upstream = {"h": gh, "c": gc}
    if dtype == np.float32:
        model, _ = load_model("lstm.cell", {"X": X, "H": H})
        model.load_params(params)
        grads = model.backward(model(forest, grad=True, x=x), upstream)
    else:
        grads = analytic(cell, forest, params, {"x": x}, upstream, np.float64)
    errors = {k: relative_error(grads[k], ref[k]) for k in ref}
    print(f"graderr[torch nn.LSTM {np.dtype(dtype).name}] max={max(errors.values()):.2e}")
    assert max(errors.values()) <= TORCH_RTOL[dtype], errors


# ------------------------------------------ 3. cells that exercise every gradient rule

INVENTED = {
    # elementwise functions, per node and per child, division, unary minus
    "elementwise": (
        "tree",
        """
cell Elementwise on tree {
    dim X = 4, H = 4
    input x[X]
    param W[H, X], U[H, H], b[H]
    state h[H]
    node {
        a = W @ x + U @ sum(child.h) + b
        e1 = sigmoid(a) * tanh(a) + relu(a) - relu(-a) * 0.5
        e2 = exp(-abs(a)) + log(1 + a * a) + abs(a - 3) + relu(tanh(a) + 2) + relu(tanh(a) - 2)
        e3 = softplus(a) / (1 + softplus(-a))
        k  = sum(sigmoid(U @ child.h) * exp(-abs(child.h)) / (1.5 + softplus(child.h)) - relu(-child.h))
        h  = tanh(e1 - e2 / 4 + e3 - k + log(sigmoid(a)))
    }
}""",
    ),
    "softmax": (
        "tree",
        """
cell Softmaxes on tree {
    dim X = 4, H = 5, C = 3
    input x[X]
    param W[H, X], U[H, H], b[H], W_o[C, H], b_o[C]
    state h[H]
    node {
        p = softmax(W @ x + b)
        q = log_softmax(U @ child.h + W @ x)
        h = p * tanh(U @ sum(child.h) + W @ x) + sum(softmax(q) * child.h) + mean(q) / H
    }
    output probs[C] = softmax(W_o @ h + b_o)
    output logp[C] = log_softmax(W_o @ h) * 0.5
}""",
    ),
    # vector slices and concats; matrix states; concat of matrices; matrix-matrix of per-node matrices
    "matrices": (
        "binary",
        """
cell Matrices on tree(arity = 2) {
    dim X = 3, H = 3
    input x[X]
    param W_x[H, X], W[H, 3*H+X], W_M[H, 2*H], P[H, H], b[2*H]
    state h[H], M[H, H]
    leaf {
        h = tanh(W_x @ x + b[H:2*H])
        M = tanh(P) * 0.5
    }
    node {
        h0 = child[0].h
        z = concat(h0[0:1], x, h0[1:H], child[1].M @ h0, child[0].M @ child[1].h)
        M = tanh(W_M @ concat(child[0].M, child[1].M)) + child[0].M @ child[1].M / H
        h = tanh(W @ z + concat(b[0:1], b[1:H])) * sigmoid(M @ M @ child[1].h)
    }
    output y[H] = M @ h + concat(h[H-1:H], h[0:H-1])
}""",
    ),
    # per-child matrices: GEMMs with per-child operands, concat of a per-child and a param matrix
    "child_matrices": (
        "tree",
        """
cell ChildMatrices on tree {
    dim X = 3, H = 3
    input x[X]
    param W_x[H, X], W_M[H, 2*H], P[H, H], Q[H, H]
    state h[H], M[H, H]
    leaf { h = tanh(W_x @ x); M = tanh(P) }
    node {
        h = tanh(W_x @ x + sum(child.M @ child.h) + sum(child.M) @ (W_x @ x) + mean(Q @ child.M @ child.h))
        M = tanh(P + sum(W_M @ concat(child.M, P)) / 2 + sum(child.M @ Q) / 4)
    }
}""",
    ),
    # reductions over children: sum, mean, max of per-child values, sum(1), mixing with per-node values
    "reductions": (
        "tree",
        """
cell Reductions on tree {
    dim X = 4, H = 4
    input x[X]
    param W[H, X], U[H, H], b[H], W_f[H, X], U_f[H, H]
    state h[H], c[H]
    node {
        a = W @ x + b
        hs = U @ child.h
        f = sigmoid(W_f @ x + U_f @ child.h + b)
        c = sum(f * child.c) + tanh(a) * sum(1) / 4 + mean(a * child.h) + sum(a - child.c) / 8
        m = mean(tanh(a) * child.h)
        h = tanh(sum(hs) + mean(child.h) + max(hs) + a / (sum(1) + 1) + max(child.c) * 0.5 + c + m)
    }
}""",
    ),
    # scalar broadcasts: literals, dims as scalars, a per-node scalar times a vector
    "scalars": (
        "tree",
        """
cell Scalars on tree {
    dim X = 4, H = 4
    input x[X]
    param W[H, X], U[H, H], b[H]
    state h[H]
    node {
        a = W @ x + b
        n = sum(1)
        h = tanh(2 * a - a / H + H * 0.1 + n * a / 3 + (1 - sigmoid(a)) * X - U @ sum(child.h) / (n + 1)
                 + sum(child.h * n) / 4 + 1 / (2 + a * a))
    }
}""",
    ),
    # param-only expressions in leaf, node and output; inputs read in outputs; output at root
    "params_only": (
        "binary",
        """
cell ParamsOnly on tree(arity = 2) {
    dim X = 3, H = 4, C = 2
    input x[X]
    param W[H, X], W2[H, H], b[H], P[H, H], W_o[C, H], b_o[C]
    state h[H]
    leaf { h = tanh(W @ x) * sigmoid(b) + W2 @ b }
    node {
        h = tanh(W2 @ (child[0].h - child[1].h) + sigmoid(b) * (W @ x) + tanh(P @ P) @ b + P @ sigmoid(b))
    }
    output y[H] = sigmoid(b) * h + W2 @ b + tanh(W @ x)
    output r[C] at root = W_o @ h + b_o * sigmoid(b[0:C])
}""",
    ),
    # a look-up at every node with few words, so that rows repeat; the table also in the output
    "embed": (
        "tree",
        """
cell Embed on tree {
    dim V = 3, X = 4, H = 4, C = 2
    input w : index[V]
    param E[V, X], W[H, X], U[H, H], W_o[C, X]
    state h[H]
    node { h = tanh(W @ E[w] + sum(U @ child.h) + W @ sum(E[w] * child.h)) }
    output o[C] = W_o @ E[w]
}""",
    ),
    # attention over children: [1] scores and [H] component-wise ones, [1] values broadcast, v[k] subscripts
    "child_softmax": (
        "tree",
        """
cell AttnTree on tree {
    dim X = 4, H = 4
    input x[X]
    param W[H, X], U[H, H], w_a[1, H], V[H, H], b[H]
    state h[H]
    node {
        wx = W @ x + b
        g = wx[1]
        s = w_a @ tanh(U @ child.h + wx)
        a = child_softmax(s)
        q = child_softmax(V @ child.h)
        h = tanh(sum(a * child.h) + g * sum(q * child.h) + wx / (2 + g * g) + sum(a[0] * s) + wx[H - 1])
    }
}""",
    ),
    # an arity cell: missing children take no part in the softmax (child[k] of a missing child is 0)
    "child_softmax_arity": (
        "arity3",
        """
cell AttnArity on tree(arity = 3) {
    dim X = 4, H = 4
    input x[X]
    param W[H, X], U[H, H], w_a[1, H], b[H]
    state h[H], c[H]
    node {
        a = child_softmax(w_a @ child.h + w_a @ (W @ x))
        h = tanh(W @ x + sum(a * child.c) + U @ child[2].h + b)
        c = sum(a * child.h) + child[1].c
    }
}""",
    ),
    # edges (Version 3): each child weighted by its place and its number of siblings, and the edges to
    # children 0 and 2 of an arity cell (0 where the child is missing); no gradient flows into them
    "edges": (
        "arity3",
        """
cell Edges on tree(arity = 3) {
    dim X = 4, H = 4
    input x[X]
    param W[H, X], U[H, H], V[H, H], b[H]
    state h[H], c[H]
    node {
        w = (edge.position + 1) / edge.siblings
        h = tanh(W @ x + sum(w * (U @ child.h)) + edge[2].position * (V @ child[2].h) + b)
        c = sum((1 - w) * child.c) + edge[0].siblings * child[0].h
    }
}""",
    ),
    # a DAG: a shared child is in the softmax of each of its parents
    "child_softmax_dag": (
        "dag",
        """
cell AttnDag on dag {
    dim X = 4, H = 4
    input x[X]
    param W[H, X], U[H, H], w_a[1, H], b[H]
    state h[H]
    node {
        a = child_softmax(w_a @ tanh(U @ child.h))
        h = tanh(W @ x + U @ sum(a * child.h) + b)
    }
}""",
    ),
}


def invented_forest(kind: str, rng) -> Forest:
    if kind == "tree":
        return Forest.concat([Forest.random(3, rng, max_children=4, max_nodes=10), Forest.from_parents([-1])])
    if kind == "arity3":  # nodes with 1, 2 or 3 children: child[k] is missing at some
        return Forest.concat([Forest.random(3, rng, max_children=3, max_nodes=10), Forest.from_parents([1, 2, -1])])
    if kind == "dag":
        return example_forest("dag", rng)
    return Forest.concat([Forest.random(3, rng, binary=True, max_nodes=9), Forest.from_parents([-1])])


@pytest.mark.parametrize("name", sorted(INVENTED))
def test_invented_cell_gradients_vs_finite_differences(name, rng):
    kind, source = INVENTED[name]
    cell = inline(source)
    focus = {"E": "w"} if name == "embed" else None
    fd_case(cell, invented_forest(kind, rng), rng, name, focus_rows=focus)


def forward_ops(cell) -> set[tuple[Op, tuple[Domain, ...], tuple[int, ...]]]:
    """(op, domains of the args, ranks of the args) of every value of every forward body."""
    bodies = [cell.leaf, cell.node, cell.pre, *(o.body for o in cell.outputs)]
    seen = set()
    for body in bodies:
        if body is None:
            continue
        for value in body.values:
            args = [body.values[a] for a in value.args]
            seen.add((value.op, tuple(a.domain for a in args), tuple(len(a.shape) for a in args)))
    return seen


def test_the_tested_cells_reach_every_gradient_rule():
    cells = [inline(src) for _, src in INVENTED.values()]
    cells += [example(name, **dims) for name, (dims, _) in EXAMPLE_CASES.items()]
    seen = set().union(*(forward_ops(c) for c in cells))
    ops = {op for op, _, _ in seen}
    # (edge inputs: their gradients against torch.autograd in tests/language/test_edge_inputs.py)
    user_ops = (LEAF_OPS - {Op.ADJOINT, Op.SAVED, Op.NUM_CHILDREN, Op.EDGE_INPUT}) | {
        Op.ADD,
        Op.SUB,
        Op.MUL,
        Op.DIV,
        Op.NEG,
        Op.SIGMOID,
        Op.TANH,
        Op.RELU,
        Op.EXP,
        Op.LOG,
        Op.ABS,
        Op.SOFTPLUS,
        Op.SOFTMAX,
        Op.LOG_SOFTMAX,
        Op.MATMUL,
        Op.SLICE,
        Op.CONCAT,
        Op.EMBED,
        Op.RESHAPE,  # a 3-D param's views (rntn.cell)
        # (no EXPAND: a reduction takes per-child values or numbers, sum(1), which have no gradient)
        Op.SUM,
        Op.MEAN,
        Op.MAX,
        Op.CHILD_SOFTMAX,
    }
    assert user_ops <= ops, f"not exercised: {user_ops - ops}"
    P, N, C = Domain.PARAM, Domain.NODE, Domain.CHILD
    wanted = {
        "matrix @ vector, per-child vector": lambda o, d, r: o == Op.MATMUL and r == (2, 1) and d[1] == C,
        "matrix @ vector, per-child matrix": lambda o, d, r: o == Op.MATMUL and r == (2, 1) and d[0] == C,
        "per-node matrix @ per-node matrix": lambda o, d, r: o == Op.MATMUL and r == (2, 2) and d == (N, N),
        "per-child matrix @ param matrix": lambda o, d, r: o == Op.MATMUL and r == (2, 2) and d == (C, P),
        "param matrix @ param vector": lambda o, d, r: o == Op.MATMUL and d == (P, P) and r == (2, 1),
        "param @ param matrices": lambda o, d, r: o == Op.MATMUL and d == (P, P) and r == (2, 2),
        "concat of matrices": lambda o, d, r: o == Op.CONCAT and 2 in r,
        "concat of a per-child and a param matrix": lambda o, d, r: o == Op.CONCAT and d == (C, P) and r == (2, 2),
        "elementwise param-only": lambda o, d, r: o == Op.SIGMOID and d == (P,),
        "per-node scalar times vector": lambda o, d, r: o == Op.MUL and d[0] == N and r == (0, 1),
        "per-node times per-child": lambda o, d, r: o == Op.MUL and set(d) == {N, C} and r == (1, 1),
        "divide by per-node vector": lambda o, d, r: o == Op.DIV and d[1] == N and r[1] == 1,
        "divide by per-child vector": lambda o, d, r: o == Op.DIV and d[1] == C,
        "per-child softmax": lambda o, d, r: o == Op.SOFTMAX and d == (C,),
        "per-child log_softmax": lambda o, d, r: o == Op.LOG_SOFTMAX and d == (C,),
        "max of a per-child value": lambda o, d, r: o == Op.MAX and d == (C,),
        "sum of a per-child matrix": lambda o, d, r: o == Op.SUM and d == (C,) and r == (2,),
        "expand of a scalar (sum(1))": lambda o, d, r: o == Op.EXPAND and r == (0,),
        "child_softmax of a per-child vector": lambda o, d, r: o == Op.CHILD_SOFTMAX and d == (C,),
    }
    missing = [what for what, test in wanted.items() if not any(test(*s) for s in seen)]
    assert not missing, missing


def test_max_over_tied_children_shares_the_gradient():
    """Children whose states tie for ``max`` share its gradient (as torch.amax): each gets 1/3 of it, not
    the whole (a reduction reads per-child values only: `mean(x)` of a per-node x is an error)."""
    cell = inline("""
cell MaxOfTies on tree {
    dim X = 2
    input x[X]
    state h[X]
    leaf { h = x }
    node { h = max(child.h) + mean(child.h) + x }
}""")
    forest = Forest.from_parents([3, 3, 3, -1])  # a root with three leaves
    x = np.array([[1.0, 2.0]] * 3 + [[5.0, 7.0]])
    out = reference.run(cell, forest, {}, {"x": x}, np.float64)
    np.testing.assert_array_equal(out["h"][3], 2 * x[0] + x[3])
    upstream = {"h": np.zeros((4, 2))}
    upstream["h"][3] = 1.0
    grads = analytic(cell, forest, {}, {"x": x}, upstream)
    expected = np.zeros((4, 2))
    expected[:3] = 2.0 / 3.0  # max: a third each (tied), mean: a third each
    expected[3] = 1.0
    np.testing.assert_allclose(grads["x"], expected, rtol=1e-12)


def test_leaf_specialisation_of_a_node_body_whose_leaf_part_is_param_only(rng):
    """Without a leaf block, `tanh(U @ sum(child.h) + b)` is `tanh(b)` at a leaf: a param-only value
    (the specialiser must give it the PARAM domain, or compute it per node)."""
    source = """
cell ParamLeaf on tree {
    dim H = 3
    param U[H, H], b[H]
    state h[H]
    node { h = tanh(U @ sum(child.h) + b) }
}"""
    cell = inline(source)
    assert all(v.domain == Domain.PARAM for v in cell.leaf.values)
    fd_case(cell, Forest.random(3, rng, max_children=3, max_nodes=8), rng, "param-only leaf")


# ---------------------------------------------------------- embeddings, DAGs, missing children


def test_dense_embedding_gradient_sums_the_rows_of_repeated_words(rng):
    """E[w] against the same cell fed x = E[w] as a float input: the table's gradient is the
    scatter-add of the input gradients over the words (repeated words sum)."""
    lookup = inline("""
cell Lookup on tree {
    dim V = 4, X = 3, H = 3
    input w : index[V]
    param E[V, X], W[H, X], U[H, H]
    state h[H]
    node { h = tanh(W @ E[w] + sum(U @ child.h)) }
}""")
    dense = inline("""
cell Dense on tree {
    dim X = 3, H = 3
    input x[X]
    param W[H, X], U[H, H]
    state h[H]
    node { h = tanh(W @ x + sum(U @ child.h)) }
}""")
    forest = Forest.random(4, rng, max_children=3, min_nodes=5, max_nodes=12)
    words = rng.integers(0, 3, forest.num_nodes).astype(np.int32)  # word 3 never used
    params = rand_params(lookup, rng)
    upstream = {"h": rng.standard_normal((forest.num_nodes, 3))}
    got = analytic(lookup, forest, params, {"w": words}, upstream)
    ref = analytic(dense, forest, {"W": params["W"], "U": params["U"]}, {"x": params["E"][words]}, upstream)
    expected = np.zeros_like(params["E"])
    np.add.at(expected, words, ref["x"])
    assert np.bincount(words).max() > 1
    np.testing.assert_allclose(got["E"], expected, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(got["E"][3], 0.0)
    np.testing.assert_allclose(got["W"], ref["W"], rtol=1e-12)


def unroll(children: list[list[int]], roots: list[int]) -> tuple[list[int], list[int]]:
    """The DAG as a tree, every shared node duplicated: (parents, original node of each copy)."""
    parents: list[int] = []
    origin: list[int] = []

    def walk(n: int) -> int:
        kids = [walk(k) for k in children[n]]
        me = len(parents)
        parents.append(-1)
        origin.append(n)
        for k in kids:
            parents[k] = me
        return me

    for r in roots:
        walk(r)
    return parents, origin


def test_dag_gradient_equals_unrolled_tree_with_duplicated_shared_nodes(rng):
    cell = example("dagrnn.cell", X=4, H=3)
    dag, kids = own_random_dag(rng, 12)
    readers = np.bincount(sum(kids, []), minlength=12)
    parents, origin = unroll(kids, [int(r) for r in np.flatnonzero(readers == 0)])
    origin = np.array(origin)
    tree = Forest.from_parents(parents)
    assert [sorted(origin[tree.children(i)]) for i in range(tree.num_nodes)] == [sorted(kids[o]) for o in origin]
    params = rand_params(cell, rng)
    x = rng.standard_normal((12, 4))
    g_tree = rng.standard_normal((tree.num_nodes, 3))
    g_dag = np.zeros((12, 3))
    np.add.at(g_dag, origin, g_tree)  # copies share the value, so they share the loss term
    out_dag = reference.run(cell, dag, params, {"x": x}, np.float64)
    out_tree = reference.run(cell, tree, params, {"x": x[origin]}, np.float64)
    np.testing.assert_allclose(out_tree["h"], out_dag["h"][origin], rtol=1e-13)
    grad_dag = analytic(cell, dag, params, {"x": x}, {"h": g_dag})
    grad_tree = analytic(cell, tree, params, {"x": x[origin]}, {"h": g_tree})
    summed = np.zeros_like(x)
    np.add.at(summed, origin, grad_tree["x"])
    np.testing.assert_allclose(grad_dag["x"], summed, rtol=1e-10, atol=1e-12)
    for name in params:
        np.testing.assert_allclose(grad_dag[name], grad_tree[name], rtol=1e-10, atol=1e-12)


def test_dag_shared_node_gets_the_sum_of_its_parents_gradients_by_hand(rng):
    """A linear DAG cell: dL/dx_n = g_n + sum over the readers p of n (with multiplicity) of dL/dx_p."""
    cell = inline("""
cell Linear on dag {
    dim X = 3
    input x[X]
    state h[X]
    node { h = x + sum(child.h) * 2 }
}""")
    dag, kids = own_random_dag(rng, 20)
    g = rng.standard_normal((20, 3))
    expected = np.zeros((20, 3))
    for n in reversed(topo_order(kids)):  # readers before what they read
        expected[n] += g[n]
        for k in kids[n]:
            expected[k] += 2 * expected[n]
    got = analytic(cell, dag, {}, {"x": rng.standard_normal((20, 3))}, {"h": g})
    np.testing.assert_allclose(got["x"], expected, rtol=1e-12, atol=1e-12)


def test_missing_children_get_no_gradient_and_nothing_breaks():
    """arity 3, nodes with 0, 1, 2 and 3 children; the cell reads child[0] and child[2] only:
    dL/dx_n = g_n + 2 dL/dx_p if n is child 0 of p, + 3 dL/dx_p if n is child 2 of p, else g_n."""
    cell = inline("""
cell Sparse on tree(arity = 3) {
    dim X = 2
    input x[X]
    state h[X]
    node { h = x + 2 * child[0].h + 3 * child[2].h }
}""")
    #          node:  0  1  2  3  4  5  6  7  8  9
    parents = np.array([2, 2, 6, 6, 5, 6, 9, 9, 9, -1])
    # 2 has children (0, 1); 5 has (4); 6 has (2, 3, 5); 9 has (6, 7, 8)
    forest = Forest.from_parents(parents)
    kids = children_of(parents)
    rng = np.random.default_rng(0)
    g = rng.standard_normal((10, 2))
    expected = np.zeros((10, 2))
    for n in reversed(range(10)):
        expected[n] += g[n]
        for position, weight in ((0, 2), (2, 3)):
            if position < len(kids[n]):
                expected[kids[n][position]] += weight * expected[n]
    got = analytic(cell, forest, {}, {"x": rng.standard_normal((10, 2))}, {"h": g})
    np.testing.assert_allclose(got["x"], expected, rtol=1e-13)
    np.testing.assert_array_equal(got["x"][[1, 3]], g[[1, 3]])  # child 1 of its parent: only its own term


@pytest.mark.parametrize("name", ["binary_treelstm.cell", "treernn.cell", "mvrnn.cell"])
def test_arity_cells_on_nodes_with_fewer_children_vs_finite_differences(name, rng):
    dims, _ = EXAMPLE_CASES[name]
    cell = example(name, **dims)
    if name == "mvrnn.cell":  # reads child[1].A @ child[0].h: a missing child 1 reads 0
        forest = Forest.from_parents([2, 2, 4, 4, 5, 7, 7, -1])  # node 5 has one child
    else:
        forest = Forest.concat([Forest.random(3, rng, max_children=2, max_nodes=12), Forest.from_parents([1, -1])])
    assert any(len(forest.children(i)) == 1 for i in range(forest.num_nodes))
    focus = {"E": "word"} if name == "binary_treelstm.cell" else None
    fd_case(cell, forest, rng, f"{name} with unary nodes", focus_rows=focus)


def test_arity_three_cell_vs_finite_differences(rng):
    cell = inline("""
cell Ternary on tree(arity = 3) {
    dim X = 3, H = 3
    input x[X]
    param W[H, X], U0[H, H], U1[H, H], U2[H, H], b[H]
    state h[H], c[H]
    node {
        h = tanh(W @ x + U0 @ child[0].h + U1 @ child[1].h + U2 @ child[2].h + b)
        c = sigmoid(b) * child[1].c + tanh(child[2].h * child[0].c) + h
    }
}""")
    forest = Forest.concat([Forest.random(4, rng, max_children=3, max_nodes=12), Forest.from_parents([-1])])
    fd_case(cell, forest, rng, "arity 3 with 0..3 children")


def test_forest_of_leaves_only(rng):
    """Only leaves: the node body never runs; its params get zero gradients."""
    cell = example("treernn.cell", X=4, H=3)
    forest = Forest.from_parents([-1, -1, -1])
    worst = fd_case(cell, forest, rng, "treernn leaves only")
    params = rand_params(cell, rng)
    x = rng.standard_normal((3, 4))
    grads = analytic(cell, forest, params, {"x": x}, {"h": rng.standard_normal((3, 3))})
    np.testing.assert_array_equal(grads["W"], 0.0)
    assert worst


# ------------------------------------------------------------------ the model API


@pytest.fixture
def binary_model():
    model, cell = load_model("binary_treelstm.cell", {"V": 7, "X": 5, "H": 4, "C": 5})
    forest = Forest.random(3, 0, binary=True, max_nodes=9)
    words = np.random.default_rng(0).integers(0, 7, forest.num_nodes).astype(np.int32)
    return model, forest, words


def test_backward_without_grad_is_a_clear_error(binary_model):
    model, forest, words = binary_model
    out = model(forest, word=words)
    with pytest.raises(CortexcError, match="grad=True"):
        model.backward(out, {"logits": np.ones_like(out["logits"])})


def test_backward_unknown_upstream_name(binary_model):
    model, forest, words = binary_model
    out = model(forest, grad=True, word=words)
    with pytest.raises(InputError, match="nope"):
        model.backward(out, {"nope": np.ones((forest.num_nodes, 5))})


@pytest.mark.parametrize("name, shape", [("logits", (1, 5)), ("h", (4,)), ("c", (2, 3, 4))])
def test_backward_upstream_of_the_wrong_shape(binary_model, name, shape):
    model, forest, words = binary_model
    out = model(forest, grad=True, word=words)
    with pytest.raises(InputError, match=f"gradient of {name} must have shape"):
        model.backward(out, {name: np.ones(shape)})


def test_output_at_root_upstream_has_one_row_per_root(rng):
    cell = inline(INVENTED["params_only"][1])
    forest = Forest.random(3, rng, binary=True, max_nodes=7)
    out = reference.run(cell, forest, rand_params(cell, rng), f64(random_inputs(cell, forest, rng)), np.float64)
    assert out["r"].shape == (3, 2)
    fd_case(cell, forest, rng, "output at root only", upstream_names={"r"})


def test_backward_partial_upstream_is_zero_for_the_rest_and_repeatable(binary_model):
    model, forest, words = binary_model
    rng = np.random.default_rng(1)
    out = model(forest, grad=True, word=words)
    g = rng.standard_normal(out["logits"].shape).astype(np.float32)
    first = model.backward(out, {"logits": g})
    again = model.backward(out, {"logits": g, "h": np.zeros_like(out["h"]), "c": np.zeros_like(out["c"])})
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])
    assert set(first) == set(model.params)  # the index input gets nothing
    assert "word" not in first


def test_cpu_backward_is_a_clear_error_or_matches_the_interpreter(binary_model):
    """device='cpu': a backward not built says so (naming device='interp'); a built one agrees."""
    _, forest, words = binary_model
    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", V=7, X=5, H=4, C=5)
    model = module.BinaryTreeLSTM(device="cpu")
    try:
        out = model(forest, grad=True, word=words)
    except CortexcError as err:  # no C compiler here
        pytest.skip(f"compiled forward unavailable: {err}")
    try:
        grads = model.backward(out, {"logits": np.ones_like(out["logits"])})
    except CortexcError as err:
        assert "interp" in str(err)
    else:  # once the compiled backward lands it must agree with the interpreter
        ref_model = module.BinaryTreeLSTM(device="interp")
        ref = ref_model.backward(ref_model(forest, grad=True, word=words), {"logits": np.ones_like(out["logits"])})
        for k in ref:
            assert relative_error(grads[k], ref[k]) <= 1e-4, k
