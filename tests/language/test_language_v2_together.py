"""The version 2 features used together: dropout on attention weights (`child_softmax`), `[1]` scores and
`v[k]` subscripts in one cell, on every device; and `CellModule`'s CUDA host path (emulated) in training
mode, whose masks must be the cpu module's.

The reference is written here per node in torch (float64) with the masks of `cortexc.runtime.philox`, so
it shares nothing with the compiler but the contract's formula.
"""

from __future__ import annotations

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.runtime import philox
from tests.helpers import EXAMPLES, relative_error

torch = pytest.importorskip("torch")

CELL = """
cell AttnDrop on tree {
    dim X = 6, H = 5
    input x[X]
    param W[H, X], U[H, H], w_a[2, H], b[H]
    state h[H]
    node {
        s = w_a @ child.h                                # [2] per child
        a = dropout(child_softmax(s[0] + s[1:2]), 0.4)   # [1] per child: site 0, slot 1 + i
        g = dropout(tanh(W @ x + b), 0.25)               # per node: site 1, slot 0
        r = x[0] * dropout(x[0:H], 0.5)                  # a [1] subscript weighting [H]: site 2
        h = g * sigmoid(U @ sum(a * child.h)) + r
    }
}
"""


@pytest.fixture(scope="module")
def attn_drop(tmp_path_factory):
    path = tmp_path_factory.mktemp("v2") / "attn_drop.cell"
    path.write_text(CELL)
    return cortexc.load(path, out_dir=tmp_path_factory.mktemp("v2_pkg")).AttnDrop


def _mask(seed: int, site: int, p: float, node: int, slot: int, width: int):
    keep = philox.keep_mask(seed, site, p, node, slot, np.arange(width))
    return torch.tensor(np.where(keep, np.float64(philox.scale(p)), 0.0))


def _torch_per_node(params, forest: Forest, x: np.ndarray, seed: int | None):
    """The cell one node at a time, children before parents; `seed` None: evaluation mode."""
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    xs = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    H = t["b"].shape[0]
    h: dict[int, torch.Tensor] = {}

    def masked(value, site, p, node, slot):
        return value if seed is None else value * _mask(seed, site, p, node, slot, value.shape[-1])

    for node in forest.level_order.tolist():
        kids = [int(k) for k in forest.children(node)]
        g = masked(torch.tanh(t["W"] @ xs[node] + t["b"]), 1, 0.25, node, 0)
        child_h = torch.stack([h[k] for k in kids]) if kids else torch.zeros((0, H), dtype=torch.float64)
        s = child_h @ t["w_a"].T  # [m, 2]
        attended = torch.zeros(H, dtype=torch.float64)
        if kids:
            a = torch.softmax(s[:, 0] + s[:, 1], dim=0)
            a = torch.stack([masked(a[i : i + 1], 0, 0.4, node, 1 + i) for i in range(len(kids))])
            attended = (a * child_h).sum(0)
        r = xs[node, 0] * masked(xs[node, :H], 2, 0.5, node, 0)
        h[node] = g * torch.sigmoid(t["U"] @ attended) + r
    return t, xs, torch.stack([h[n] for n in range(forest.num_nodes)])


def _forest(rng) -> Forest:
    """Trees of mixed arity (1 to 4 children), a lone leaf and a chain: every slot count the masks see."""
    return Forest.concat(
        [
            Forest.random(5, rng, max_children=4, max_nodes=20),
            Forest.from_nested([[]]),
            Forest.from_nested([[[[]]]]),
            Forest.from_nested([[[], [], [], []]]),
        ]
    )


@pytest.mark.parametrize("device", ["interp", "cpu", "cuda-emu"])
def test_dropout_of_attention_weights_matches_torch_per_node(attn_drop, device, rng):
    forest = _forest(rng)
    model = attn_drop(device=device, seed=int(rng.integers(1 << 30)))
    params = {k: v + 0.3 * rng.standard_normal(v.shape).astype(np.float32) for k, v in model.params.items()}
    model.load_params(params)
    x = rng.standard_normal((forest.num_nodes, 6)).astype(np.float32)
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    out = model(forest, grad=True, train=True, dropout_seed=seed, x=x)
    t, xs, h = _torch_per_node(params, forest, x, seed)
    assert relative_error(out["h"], h.detach().numpy()) < 1e-5
    up = rng.standard_normal(out["h"].shape).astype(np.float32)
    (h * torch.tensor(up, dtype=torch.float64)).sum().backward()
    grads = model.backward(out, {"h": up})
    for name, tensor in t.items():
        assert relative_error(grads[name], tensor.grad.numpy()) < 1e-4, (device, name)
    assert relative_error(grads["x"], xs.grad.numpy()) < 1e-4, device
    # evaluation mode: no masks at all
    plain = model(forest, x=x)
    assert relative_error(plain["h"], _torch_per_node(params, forest, x, None)[2].detach().numpy()) < 1e-5


def test_masks_agree_bitwise_between_interp_cpu_and_cuda_emu(attn_drop, rng):
    """Inputs that are powers of two and params of zero attention keep every product exact, so the three
    devices must agree bit for bit on which elements were dropped (a zero is a dropped element)."""
    forest = _forest(rng)
    x = np.exp2(rng.integers(-3, 3, (forest.num_nodes, 6))).astype(np.float32)
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    dropped = []
    for device in ("interp", "cpu", "cuda-emu"):
        h = attn_drop(device=device, seed=3)(forest, train=True, dropout_seed=seed, x=x)["h"]
        dropped.append(h == 0)
    assert dropped[0].any() and not dropped[0].all()
    assert np.array_equal(dropped[0], dropped[1]) and np.array_equal(dropped[0], dropped[2])


# ------------------------------------------------------------------ CellModule's CUDA host path, training
def test_cuda_host_path_replays_the_cpu_modules_masks(rng):
    """`.to("cuda")` runs the device executors' caller-allocated calls; in training mode they must take the
    dropout seed of the call (here through the emulated CUDA library on CPU tensors) and the backward must
    replay it: forward and every gradient equal the cpu module's under the same torch seed."""
    from cortexc.torch import CellModule, ForestBatch

    dims = {"V": 40, "X": 6, "H": 5, "C": 3}
    cls = cortexc.load(EXAMPLES / "treelstm_dropout.cell", **dims).DropoutTreeLSTM
    on_cpu, emulated = CellModule(cls, seed=4), CellModule(cls, seed=4)
    with torch.no_grad():
        for p, q in zip(on_cpu.parameters(), emulated.parameters()):
            p.add_(torch.from_numpy(0.3 * rng.standard_normal(p.shape).astype(np.float32)))
            q.copy_(p)
    emulated.use_backend("cuda-emu")
    forest = Forest.random(4, rng=rng, binary=True, max_children=2, max_nodes=11)
    batch = ForestBatch.from_forest(forest)
    word = torch.as_tensor(rng.integers(0, dims["V"], forest.num_nodes))
    results = []
    for module in (on_cpu, emulated):
        module.zero_grad()
        torch.manual_seed(21)
        out = module(batch, word=word)
        out["logits"].square().sum().backward()
        results.append((out["logits"].detach().clone(), {n: p.grad.clone() for n, p in module.named_parameters()}))
    (cpu_out, cpu_grads), (emu_out, emu_grads) = results
    assert relative_error(emu_out.numpy(), cpu_out.numpy()) < 1e-5
    for name, grad in cpu_grads.items():
        assert relative_error(emu_grads[name].numpy(), grad.numpy()) < 1e-4, name
    # and the masks were on: evaluation mode gives another result
    on_cpu.eval()
    assert not torch.allclose(on_cpu(batch, word=word)["logits"], cpu_out)
