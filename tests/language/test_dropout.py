"""`dropout(e, p)` (the contract: ../shared/spec/cell-language.md, "Dropout").

- Philox-4x32-10 against the Random123 known-answer vectors: the NumPy version (`cortexc.runtime.philox`,
  whole blocks) and the kernels' C helper (`cortexc.ir.ops`, compiled by gcc: its first word).
- The masks themselves, bitwise: a probe cell whose results are exactly the scaled masks (per node, per child,
  per-node and at-root outputs) against `keep_mask` on the interpreter, the compiled C and emulated CUDA.
- The Tree-LSTM with recurrent dropout (examples/treelstm_dropout.cell): train-mode forward and gradients
  against a per-node torch implementation written here with the NumPy masks, finite differences, p = 0, eval
  mode against the cell without dropout, seeds, 1 and 2 threads in fresh processes, SST trees.
- The front end's located errors and the Python API's typed errors.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import cortexc
from cortexc import Forest, reference
from cortexc.errors import CellTypeError, InputError
from cortexc.ir.ops import OPS, Op
from cortexc.runtime import philox
from cortexc.runtime.philox import Dropout, keep_mask, philox4x32
from tests.helpers import (
    EXAMPLES,
    EXAMPLES_BY_NAME,
    REPO,
    load_example,
    random_inputs,
    relative_error,
    small_forest,
    sst_path,
)

#: Random123's kat_vectors for philox4x32_10: counter, key, the four output words
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


# ------------------------------------------------------------------------------------------- Philox
@pytest.mark.parametrize("counter, key, expected", KAT)
def test_numpy_philox_matches_the_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32(np.array(counter, np.uint32), key)) == expected
    # vectorised: the same block anywhere in a batch
    batch = np.tile(np.array(counter, np.uint32), (3, 2, 1))
    assert (philox4x32(batch, key) == np.array(expected, np.uint32)).all()


def test_numpy_philox_is_not_the_identity_of_fewer_rounds():
    counter, key, expected = KAT[2]
    assert tuple(int(w) for w in philox4x32(np.array(counter, np.uint32), key, rounds=9)) != expected


C_KAT_MAIN = r"""
#include <stdint.h>
#include <stdio.h>
#include <math.h>
%s
int main(void) {
    uint32_t c0, c1, c2, c3, k0, k1;
    while (scanf("%%x %%x %%x %%x %%x %%x", &c0, &c1, &c2, &c3, &k0, &k1) == 6) {
        uint64_t seed = ((uint64_t)k1 << 32) | k0;
        /* the mask as the kernels compute it: kept (x * scale) iff the first word >= threshold */
        float below = cx_dropout(1.0f, 1, seed, c0, c1, c2, c3, 0u, 2.0f);
        printf("%%08x %%g %%g\n", cx_philox_u0(c0, c1, c2, c3, k0, k1), below,
               cx_dropout(3.0f, 0, seed, c0, c1, c2, c3, 0xffffffffu, 2.0f));
    }
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found")
def test_c_helper_matches_the_known_answers_and_numpy(tmp_path, rng):
    entry = OPS[Op.DROPOUT]
    helpers = "\n".join(f"static inline {h}" for h in (*entry.c_helper_needs, entry.c_helper))
    (tmp_path / "kat.c").write_text(C_KAT_MAIN % helpers)
    subprocess.run(
        ["gcc", "-O3", "-ffast-math", "-march=native", "-o", str(tmp_path / "kat"), str(tmp_path / "kat.c")],
        check=True,
    )
    counters = [c + k for c, k, _ in KAT] + [tuple(int(w) for w in rng.integers(0, 2**32, 6)) for _ in range(200)]
    text = "\n".join(" ".join(f"{w:x}" for w in row) for row in counters)
    lines = subprocess.run([str(tmp_path / "kat")], input=text, capture_output=True, text=True, check=True).stdout
    words = [line.split() for line in lines.splitlines()]
    assert [int(w[0], 16) for w in words[:3]] == [expected[0] for _, _, expected in KAT]
    for row, got in zip(counters, words):
        block = philox4x32(np.array(row[:4], np.uint32), (row[4], row[5]))
        assert int(got[0], 16) == int(block[0])
        assert got[1] == "2" and got[2] == "3"  # threshold 0 keeps and scales; evaluation mode is x itself
    assert len(words) == len(counters)


def test_threshold_and_scale_follow_the_contract():
    assert philox.threshold(0.0) == 0 and philox.threshold(0.5) == 2**31 and philox.threshold(0.1) == 429496729
    assert philox.scale(0.5) == np.float32(2.0) and philox.scale(0.1) == np.float32(1.0) / np.float32(0.9)
    assert philox.scale(0.1).dtype == np.float32


def test_keep_mask_drops_about_p_and_depends_on_every_part_of_the_identity():
    element = np.arange(20000)
    kept = keep_mask(7, 2, 0.3, 11, 0, element)
    assert abs(1 - kept.mean() - 0.3) < 0.02
    for other in (
        keep_mask(8, 2, 0.3, 11, 0, element),
        keep_mask(7, 3, 0.3, 11, 0, element),
        keep_mask(7, 2, 0.3, 12, 0, element),
        keep_mask(7, 2, 0.3, 11, 1, element),
    ):
        assert (other != kept).mean() > 0.3
    # the key is (seed mod 2^32, seed div 2^32): the high word matters
    assert (keep_mask(7 + 2**32, 2, 0.3, 11, 0, element) != kept).mean() > 0.3
    assert keep_mask(7, 2, 0.0, 11, 0, element).all()


# ------------------------------------------------------------------------------------------- the masks
#: every result is exactly a scaled mask (x holds powers of two, so every product and sum is exact):
#: site 0 per node, site 1 per child (j = 1 + i), site 2 an output per node, site 3 an output at the roots
PROBE = """
cell Probe on tree {
    dim X = 7, P = 4
    input x[X]
    state one[X], a[X], s[X]
    node {
        one = x
        a = dropout(x, 0.3)
        s = sum(dropout(child.one, 2 / P))
    }
    output o[X] = dropout(one, 1 - 1 / P)
    output r[X] at root = dropout(one, 0.5)
}
"""


def _probe_forest(rng) -> Forest:
    return Forest.concat([Forest.random(6, rng, max_children=4, max_nodes=25), Forest.from_nested([[1, 2, 3, 4]])])


def _probe_expected(forest: Forest, x: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """The probe's results from `keep_mask` alone, one node at a time as the contract states them."""
    n, width = x.shape
    element = np.arange(width)
    a = np.where(keep_mask(seed, 0, 0.3, np.arange(n)[:, None], 0, element), x * philox.scale(0.3), 0)
    s = np.zeros_like(x)
    for node in range(n):
        for i, child in enumerate(forest.children(node)):
            s[node] += np.where(keep_mask(seed, 1, 0.5, node, 1 + i, element), x[child] * np.float32(2), 0)
    o = np.where(keep_mask(seed, 2, 0.75, np.arange(n)[:, None], 0, element), x * np.float32(4), 0)
    roots = np.asarray(forest.roots)
    r = np.where(keep_mask(seed, 3, 0.5, roots[:, None], 0, element), x[roots] * np.float32(2), 0)
    return {"one": x, "a": a.astype(np.float32), "s": s, "o": o.astype(np.float32), "r": r.astype(np.float32)}


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe.cell"
    path.write_text(PROBE)
    return cortexc.load(path, out_dir=tmp_path_factory.mktemp("probe_pkg")).Probe


@pytest.mark.parametrize("device", ["interp", "cpu", pytest.param("cuda-emu", marks=pytest.mark.slow)])
def test_masks_are_the_contract_s_bitwise_on_every_device(probe, device, rng):
    forest = _probe_forest(rng)
    x = np.exp2(rng.integers(-6, 6, (forest.num_nodes, 7))).astype(np.float32)
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    out = probe(device=device)(forest, train=True, dropout_seed=seed, x=x)
    assert out.dropout_seed == seed
    for name, expected in _probe_expected(forest, x, seed).items():
        assert np.array_equal(out[name], expected), (device, name)
    # evaluation mode: dropout(e, p) is e, exactly, whatever the seed
    plain = probe(device=device)(forest, dropout_seed=seed, x=x)
    assert plain.dropout_seed is None
    assert np.array_equal(plain["a"], x) and np.array_equal(plain["o"], x)


# ------------------------------------------------------------------------------------ Tree-LSTM + dropout
DIMS = {"V": 13, "X": 6, "H": 5, "C": 3}


@pytest.fixture(scope="module")
def treelstm(tmp_path_factory):
    return cortexc.load(EXAMPLES / "treelstm_dropout.cell", out_dir=tmp_path_factory.mktemp("tl"), **DIMS)


def _jittered(cls, device, seed, rng):
    model = cls(device=device, seed=seed)
    model.load_params({k: v + 0.3 * rng.standard_normal(v.shape).astype(np.float32) for k, v in model.params.items()})
    return model


def _torch_treelstm(params, forest, word, seed, train):
    """The example cell written per node in torch (float64), with the masks of `keep_mask`."""
    torch = pytest.importorskip("torch")
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    H, X = DIMS["H"], DIMS["X"]

    def drop(value, site, p, node):
        if not train:
            return value
        keep = keep_mask(seed, site, p, node, 0, np.arange(value.shape[0]))
        return value * torch.tensor(keep * float(philox.scale(p)), dtype=torch.float64)

    h, c = {}, {}
    for node in np.asarray(forest.level_order):
        node = int(node)
        kids = list(forest.children(node))
        if not kids:
            iou = t["W_iou"] @ drop(t["E"][int(word[node])], 0, 0.2, node) + t["b_iou"]
            c[node] = torch.sigmoid(iou[:H]) * drop(torch.tanh(iou[2 * H :]), 1, 0.25, node)
        else:
            zero = torch.zeros(H, dtype=torch.float64)
            h0, h1 = (h[kids[k]] if k < len(kids) else zero for k in range(2))
            c0, c1 = (c[kids[k]] if k < len(kids) else zero for k in range(2))
            hc = torch.cat([h0, h1])
            iou = t["U_iou"] @ hc + t["b_iou"]
            f = torch.sigmoid(t["U_f"] @ hc + t["b_f"])
            c[node] = torch.sigmoid(iou[:H]) * drop(torch.tanh(iou[2 * H :]), 2, 0.25, node) + f[:H] * c0 + f[H:] * c1
        h[node] = torch.sigmoid(iou[H : 2 * H]) * torch.tanh(c[node])
    n = forest.num_nodes
    hs = torch.stack([h[i] for i in range(n)])
    logits = torch.stack([t["W_s"] @ drop(h[i], 3, 0.5, i) + t["b_s"] for i in range(n)])
    assert t["E"].shape[1] == X
    return t, hs, logits


def _sst_or_random(rng, sst: bool) -> Forest:
    if sst:
        lines = sst_path("dev").read_text(encoding="utf-8").splitlines()
        return Forest.from_ptb(lines[:: len(lines) // 12][:12])
    return Forest.concat([Forest.random(5, rng, binary=True, max_nodes=21), Forest.from_nested([[[1, 2], 3], 4])])


@pytest.mark.parametrize("device", ["cpu", "interp"])
@pytest.mark.parametrize("sst", [False, True], ids=["random", "sst"])
def test_train_mode_forward_and_gradients_match_torch_per_node(treelstm, device, sst, rng):
    torch = pytest.importorskip("torch")
    forest = _sst_or_random(rng, sst)
    word = rng.integers(0, DIMS["V"], forest.num_nodes).astype(np.int32)
    model = _jittered(treelstm.DropoutTreeLSTM, device, 4, rng)
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    out = model(forest, grad=True, train=True, dropout_seed=seed, word=word)
    up_logits = rng.standard_normal(out["logits"].shape).astype(np.float32)
    up_h = rng.standard_normal(out["h"].shape).astype(np.float32)
    grads = model.backward(out, {"logits": up_logits, "h": up_h})

    t, hs, logits = _torch_treelstm(dict(model.params), forest, word, seed, train=True)
    assert relative_error(out["h"], hs.detach().numpy()) < 1e-5
    assert relative_error(out["logits"], logits.detach().numpy()) < 1e-5
    loss = (logits * torch.tensor(up_logits, dtype=torch.float64)).sum() + (
        hs * torch.tensor(up_h, dtype=torch.float64)
    ).sum()
    loss.backward()
    for name, tensor in t.items():
        assert relative_error(grads[name], tensor.grad.numpy()) < 1e-4, name
    # and training really dropped something: the eval-mode torch result differs
    _, _, plain = _torch_treelstm(dict(model.params), forest, word, seed, train=False)
    assert relative_error(out["logits"], plain.detach().numpy()) > 1e-2


def test_gradients_match_finite_differences_in_train_mode(treelstm, rng):
    cell = treelstm.DropoutTreeLSTM.cell
    forest = Forest.concat([Forest.random(2, rng, binary=True, max_nodes=9), Forest.from_nested([[1, 2], 3])])
    inputs = {"word": rng.integers(0, DIMS["V"], forest.num_nodes).astype(np.int32)}
    model = _jittered(treelstm.DropoutTreeLSTM, "interp", 2, rng)
    params = {k: v.astype(np.float64) for k, v in model.params.items()}
    mode = Dropout(True, int(rng.integers(0, 2**64, dtype=np.uint64)))
    up = rng.standard_normal((forest.num_nodes, DIMS["C"]))

    def loss(p):
        return float((reference.run(cell, forest, p, inputs, np.float64, mode)["logits"] * up).sum())

    states = reference.run(cell, forest, params, inputs, np.float64, mode)
    grads = reference.backward(cell, forest, params, inputs, states, {"logits": up}, np.float64, mode)
    for name in ("W_iou", "U_iou", "U_f", "b_iou", "W_s"):
        for flat in rng.choice(params[name].size, 3, replace=False):
            bumped = [dict(params, **{name: params[name].copy()}) for _ in range(2)]
            for sign, p in zip((1, -1), bumped):
                p[name].flat[flat] += sign * 1e-6
            numeric = (loss(bumped[0]) - loss(bumped[1])) / 2e-6
            assert abs(numeric - grads[name].flat[flat]) < 1e-5 * max(1.0, abs(numeric)), (name, flat)
    # the masks are in the gradient: without them (evaluation mode) it differs
    plain = reference.backward(
        cell,
        forest,
        params,
        inputs,
        reference.run(cell, forest, params, inputs, np.float64),
        {"logits": up},
        np.float64,
    )
    assert relative_error(grads["W_s"], plain["W_s"]) > 1e-2


def _with_p(text: str, p: str | None) -> str:
    """The example with every dropout's p replaced (None: every dropout call removed)."""
    lines = []
    for line in text.splitlines():
        if "dropout(" in line and not line.lstrip().startswith("#"):
            line = re.sub(r",\s*0\.\d+\)", ")" if p is None else f", {p})", line)
            line = line.replace("dropout(", "(") if p is None else line
        lines.append(line)
    return "\n".join(lines)


def _without_dropout(text: str, name: str) -> str:
    text = _with_p(text, None)
    assert "dropout(" not in text.split("cell ", 1)[1]
    return text.replace("cell DropoutTreeLSTM", f"cell {name}")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda-emu"])
def test_eval_mode_equals_the_cell_without_dropout(treelstm, device, rng, tmp_path):
    path = tmp_path / "plain.cell"
    path.write_text(_without_dropout((EXAMPLES / "treelstm_dropout.cell").read_text(), "PlainTreeLSTM"))
    plain_cls = cortexc.load(path, out_dir=tmp_path / "pkg", **DIMS).PlainTreeLSTM
    forest = _sst_or_random(rng, False)
    word = rng.integers(0, DIMS["V"], forest.num_nodes).astype(np.int32)
    model, plain = _jittered(treelstm.DropoutTreeLSTM, device, 1, rng), plain_cls(device=device)
    plain.load_params(model.params)
    out, expected = model(forest, grad=True, word=word), plain(forest, grad=True, word=word)
    up = {"logits": rng.standard_normal(out["logits"].shape).astype(np.float32)}
    for name in expected:
        np.testing.assert_allclose(out[name], expected[name], rtol=1e-6, atol=1e-7)
    grads, grads_plain = model.backward(out, up), plain.backward(expected, up)
    for name in grads_plain:
        np.testing.assert_allclose(grads[name], grads_plain[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_p_zero_is_the_identity_in_train_mode(rng, tmp_path):
    text = (EXAMPLES / "treelstm_dropout.cell").read_text()
    path = tmp_path / "zero.cell"
    path.write_text(_with_p(text, "0").replace("cell DropoutTreeLSTM", "cell Zero"))
    cls = cortexc.load(path, out_dir=tmp_path / "pkg", **DIMS).Zero
    forest = _sst_or_random(rng, False)
    word = rng.integers(0, DIMS["V"], forest.num_nodes).astype(np.int32)
    for device in ("cpu", "interp"):
        model = _jittered(cls, device, 1, rng)
        train = model(forest, grad=True, train=True, dropout_seed=99, word=word)
        plain = model(forest, grad=True, word=word)
        up = {"logits": np.ones_like(train["logits"])}
        # bitwise in the interpreter; the compiled code runs another copy of each loop in training mode
        # (versioned on the flag), which -ffast-math may contract differently: float32 rounding apart
        same = np.array_equal if device == "interp" else lambda a, b: relative_error(a, b) < 1e-6
        for name in plain:
            assert same(train[name], plain[name]), (device, name)
        g_train, g_plain = model.backward(train, up), model.backward(plain, up)
        for name in g_plain:
            assert same(g_train[name], g_plain[name]), (device, name)


def test_same_seed_same_result_different_seed_different_masks(treelstm, rng):
    forest = _sst_or_random(rng, False)
    word = rng.integers(0, DIMS["V"], forest.num_nodes).astype(np.int32)
    model = _jittered(treelstm.DropoutTreeLSTM, "cpu", 1, rng)
    a, b = (model(forest, train=True, dropout_seed=2**64 - 1, word=word) for _ in range(2))
    c = model(forest, train=True, dropout_seed=2**32 - 1, word=word)
    assert np.array_equal(a["logits"], b["logits"]) and np.array_equal(a["h"], b["h"])
    assert not np.allclose(a["logits"], c["logits"])


def test_seeds_from_the_model_generator_and_recorded(treelstm, rng):
    cls = treelstm.DropoutTreeLSTM
    forest = _sst_or_random(rng, False)
    word = rng.integers(0, DIMS["V"], forest.num_nodes).astype(np.int32)
    first, again = cls(seed=5), cls(seed=5)
    drawn = [first(forest, train=True, word=word).dropout_seed for _ in range(2)]
    assert drawn[0] != drawn[1] and all(isinstance(s, int) and 0 <= s < 2**64 for s in drawn)
    # an explicit seed does not advance the generator; evaluation mode draws nothing
    assert again(forest, train=True, dropout_seed=3, word=word).dropout_seed == 3
    again(forest, word=word)
    assert again(forest, train=True, word=word).dropout_seed == drawn[0]
    # the recorded seed replays the call; backward replays its masks (same gradients as the explicit seed)
    out = first(forest, grad=True, train=True, word=word)
    replay = first(forest, grad=True, train=True, dropout_seed=out.dropout_seed, word=word)
    assert np.array_equal(out["logits"], replay["logits"])
    up = {"logits": np.ones_like(out["logits"])}
    g, g_replay = first.backward(out, up), first.backward(replay, up)
    assert all(np.array_equal(g[k], g_replay[k]) for k in g)
    assert cls(seed=6)(forest, train=True, word=word).dropout_seed != drawn[0]


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "7", True, None])
def test_bad_dropout_seeds_are_typed_errors(treelstm, seed, rng):
    forest = _sst_or_random(rng, False)
    word = rng.integers(0, DIMS["V"], forest.num_nodes).astype(np.int32)
    model = treelstm.DropoutTreeLSTM()
    if seed is None:
        with pytest.raises(InputError, match="train must be True or False"):
            model(forest, train="yes", word=word)
        return
    with pytest.raises(InputError, match=r"dropout_seed must be an integer in \[0, 2\*\*64\)"):
        model(forest, train=True, dropout_seed=seed, word=word)
    model(forest, dropout_seed=seed, word=word)  # evaluation mode ignores it


#: a fresh process at a thread count: train-mode forward and backward of the example, digested
THREADS_WORKER = r"""
import hashlib, sys
import numpy as np
from pathlib import Path
from cortexc import Forest
from cortexc.runtime.loader import import_package

cls = import_package(Path(sys.argv[1])).DropoutTreeLSTM
rng = np.random.default_rng(int(sys.argv[2]))
model = cls(seed=1)
model.load_params({k: v + 0.3 * rng.standard_normal(v.shape).astype(np.float32) for k, v in model.params.items()})
forest = Forest.random(300, rng, binary=True, max_nodes=40)
word = rng.integers(0, 13, forest.num_nodes).astype(np.int32)
out = model(forest, grad=True, train=True, dropout_seed=int(sys.argv[2]) * 7919, word=word)
grads = model.backward(out, {"logits": rng.standard_normal(out["logits"].shape).astype(np.float32)})
h = hashlib.sha256()
for name, array in sorted({**out, **{"d_" + k: v for k, v in grads.items()}}.items()):
    h.update(name.encode()); h.update(np.ascontiguousarray(array).tobytes())
print(h.hexdigest())
"""


@pytest.mark.parametrize("variable", ["OMP_NUM_THREADS", "CORTEXC_NUM_THREADS"])
def test_masks_and_gradients_are_bitwise_equal_at_1_and_2_threads(treelstm, variable, rng, tmp_path):
    package = os.path.dirname(treelstm.__file__)
    treelstm.DropoutTreeLSTM()(Forest.from_parents([-1]), word=np.zeros(1, np.int32))  # built once, here
    seed = int(rng.integers(1, 2**20))
    digests = []
    for threads in (1, 2):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        env["OMP_NUM_THREADS"] = "2" if variable == "CORTEXC_NUM_THREADS" else str(threads)
        env.pop("CORTEXC_NUM_THREADS", None)
        if variable == "CORTEXC_NUM_THREADS":
            env[variable] = str(threads)
        done = subprocess.run(
            [sys.executable, "-c", THREADS_WORKER, package, str(seed)], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        digests.append(done.stdout.split()[-1])
    assert digests[0] == digests[1]


# ------------------------------------------------------------------------------------------- errors
ERROR_CELL = """cell E on tree {{
    dim H = 4
    input x[H]
    state h[H]
    node {{
        h = {expr}
    }}
}}
"""


@pytest.mark.parametrize(
    "expr, message, column",
    [
        ("dropout(x, 1)", r"p must be in \[0, 1\), but 1 is 1", 24),
        ("dropout(x, 0.5 - H)", r"p must be in \[0, 1\), but 0.5 - H is -3.5", 24),
        ("dropout(x, -0.1)", r"p must be in \[0, 1\)", 24),
        (
            "dropout(x, x)",
            r"dropout probability p must be a constant made of numbers and dims, but 'x' is an input",
            24,
        ),
        ("dropout(x, tanh(0.5))", r"dropout probability p must be a constant", 24),
        ("dropout(x)", r"dropout takes two arguments, dropout\(e, p\), got 1", 13),
        ("dropout(x, 0.1, 0.2)", r"dropout takes two arguments, dropout\(e, p\), got 3", 13),
        ("dropot(x, 0.1)", r"unknown function 'dropot' \(did you mean 'dropout'\?\)", 13),
    ],
)
def test_misused_dropout_is_a_located_error(expr, message, column, tmp_path):
    path = tmp_path / "e.cell"
    path.write_text(ERROR_CELL.format(expr=expr))
    with pytest.raises(CellTypeError, match=message) as info:
        cortexc.compile_file(path)
    assert (info.value.loc.line, info.value.loc.col) == (6, column)
    assert str(info.value).startswith(f"{path}:6:{column}:") and "^" in str(info.value)


# --------------------------------------------------------------- hoisting, per-child GEMM operands, CUDA launches
#: dropout on a hoisted product (computed in the `pre` body, over every internal node), on per-child GEMM
#: operands and per-child products, on a DAG (a shared child has a slot per parent); every CUDA launch mode
CHILD_SUM = """
cell {name} on {structure} {{
    dim X = 6, H = 5
    input x[X]
    param W_iou[3*H, X], U_iou[3*H, H], b_iou[3*H], W_f[H, X], U_f[H, H], b_f[H]
    state h[H], c[H]
    node {{
        xi  = dropout(W_iou @ x, 0.1)
        iou = xi + U_iou @ sum(dropout(child.h, 0.3)) + b_iou
        f   = sigmoid(W_f @ x + U_f @ dropout(child.h, 0.2) + b_f)
        c   = sigmoid(iou[0:H]) * tanh(iou[2*H:3*H]) + sum(dropout(f * child.c, 0.4))
        h   = dropout(sigmoid(iou[H:2*H]) * tanh(c), 0.15)
    }}
}}
"""


@pytest.mark.slow
@pytest.mark.parametrize("structure", ["tree", "dag"])
def test_hoisted_and_per_child_dropout_on_cpu_and_every_cuda_launch(structure, rng, tmp_path, monkeypatch):
    path = tmp_path / "cs.cell"
    path.write_text(CHILD_SUM.format(name="DropSum", structure=structure))
    module = cortexc.load(path, out_dir=tmp_path / "pkg")
    cls = module.DropSum
    assert any(v.op == Op.DROPOUT for v in cls.cell.pre.values), "the hoisted product keeps its dropout"
    if structure == "dag":
        forest = Forest.random_dag(40, rng, max_children=3, max_parents=3)
    else:
        forest = Forest.concat([Forest.random(5, rng, max_children=4, max_nodes=30), Forest.from_nested([[1, 2, 3]])])
    x = rng.standard_normal((forest.num_nodes, 6)).astype(np.float32)
    seed = int(rng.integers(0, 2**64, dtype=np.uint64))
    up = {"h": rng.standard_normal((forest.num_nodes, 5)).astype(np.float32)}
    reference_model = _jittered(cls, "interp", 3, rng)
    out_ref = reference_model(forest, grad=True, train=True, dropout_seed=seed, x=x)
    grads_ref = reference_model.backward(out_ref, up)
    runs = [("cpu", None)] + [("cuda-emu", mode) for mode in ("split", "persistent", "levels")]
    for device, mode in runs:
        if mode is not None:
            monkeypatch.setenv("CORTEXC_CUDA_MODE", mode)
        model = cls(device=device)
        model.load_params(reference_model.params)
        out = model(forest, grad=True, train=True, dropout_seed=seed, x=x)
        for name in ("h", "c"):
            assert relative_error(out[name], out_ref[name]) < 1e-5, (device, mode, name)
        grads = model.backward(out, up)
        for name, expected in grads_ref.items():
            assert relative_error(grads[name], expected) < 1e-4, (device, mode, name)


#: the example files that drop in training (the SST table trains three of them: rnn, rntn, bitreelstm)
DROPOUT_EXAMPLES = [name for name, path in EXAMPLES_BY_NAME.items() if "dropout(" in path.read_text(encoding="utf-8")]


@pytest.mark.slow
@pytest.mark.parametrize("name", DROPOUT_EXAMPLES)
def test_every_example_with_dropout_trains_alike_on_cpu_and_cuda_emu(name, rng, tmp_path):
    """Each cell of the file in training mode, one dropout seed: compiled C and emulated CUDA against the
    interpreter, forward and backward (the masks are the contract's on every device); and the masks act."""
    module = load_example(EXAMPLES_BY_NAME[name], {"X": 9, "H": 7, "V": 20, "C": 3}, tmp_path / "pkg")
    acted = []  # per cell: training's outputs differ from evaluation's (a two-cell file may drop in one only)
    for cell in module.__all__:
        cls = getattr(module, cell)
        reference = _jittered(cls, "interp", 3, rng)
        forest = small_forest(reference.cell, rng, 8, 20)
        inputs = random_inputs(reference.cell, forest, rng)
        seed = int(rng.integers(0, 2**63))
        expected = reference(forest, grad=True, train=True, dropout_seed=seed, **inputs)
        evaluation = reference(forest, **inputs)
        acted.append(any(relative_error(evaluation[k], v) > 1e-3 for k, v in expected.items()))
        up = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in expected.items()}
        expected_grads = reference.backward(expected, up)
        for device in ("cpu", "cuda-emu"):
            model = cls(device=device)
            model.load_params(reference.params)
            out = model(forest, grad=True, train=True, dropout_seed=seed, **inputs)
            for k, v in expected.items():
                assert relative_error(out[k], v) < 1e-5, (cell, device, k)
            grads = model.backward(out, up)
            assert set(grads) == set(expected_grads)
            for k, v in expected_grads.items():
                assert relative_error(grads[k], v) < 1e-4, (cell, device, f"d{k}")
    assert any(acted), "no cell's masks changed its outputs"


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_dropout_cells_compile_with_nvcc_without_spills(tmp_path):
    """The example at its own dims and the per-child/hoisted cell, sm_80 and sm_90 (tests/helpers.py)."""
    from tests.helpers import nvcc_compile

    (tmp_path / "cs.cell").write_text(CHILD_SUM.format(name="DropSum", structure="tree"))
    sources = []
    for path in (EXAMPLES / "treelstm_dropout.cell", tmp_path / "cs.cell"):
        module = cortexc.load(path, out_dir=tmp_path / path.stem)
        sources += sorted(p for p in __import__("pathlib").Path(next(iter(module.__path__))).glob("*.cu"))
    assert len(sources) == 2
    for source in sources:
        result = nvcc_compile(source)
        assert result.returncode == 0, f"{source.name}:\n{result.stderr[-3000:]}"
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
        assert spills and all(s == "0" and lo == "0" for s, lo in spills), f"{source.name} spills registers"
        assert "cx_dropout" in source.read_text()


def test_evaluation_mode_runs_loops_without_mask_work(treelstm):
    """Every loop with dropout has an evaluation-mode copy (taken when cx_call's flag is 0) without any."""
    source = next(p for p in __import__("pathlib").Path(next(iter(treelstm.__path__))).glob("*.c")).read_text()
    branch, versioned, outside = None, 0, []
    for line in source.splitlines():
        if "if (call->dropout_train) {" in line:
            branch, versioned = "train", versioned + 1
        elif "} else {  /* evaluation mode" in line:
            branch = "eval"
        elif branch == "eval" and line.strip() in ("}", "} }"):
            branch = None
        elif "cx_dropout(" in line:
            assert branch != "eval", line
            if branch is None:
                outside.append(line)
    assert versioned >= 8
    # a dropout value is always computed in a loop of its own (the schedule materialises it): outside the
    # versioned loops there is only the helper itself
    assert all(line.startswith("static inline") for line in outside), outside
