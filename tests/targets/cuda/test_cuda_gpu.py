"""device="cuda" on a real GPU against the reference interpreter (device="interp").

Skipped unless PyCUDA imports and finds a GPU; with ``CORTEXC_REQUIRE_GPU=1`` (set by
scripts/gpu_check.sh on the GPU machine) a missing PyCUDA, GPU or SST file fails instead.

- every ``examples/*.cell`` in every launch mode at small dims (and at middling dims, for more than one GEMM
  panel and tile), on random forests: forward within 1e-5 and backward within 1e-4 of the interpreter
  (normwise relative error: max |gpu - ref| / max |ref|);
- the binary Tree-LSTM at H = 256 on SST dev trees (``$CORTEXC_SST_DIR`` or ``.gpu/sst`` or
  ``../shared/data/sst``): forward on 100 trees, backward on 20, against the interpreter;
- `cortexc.torch.CellModule` moved to the GPU (``.to("cuda")``) against the same module on the cpu:
  forward and every gradient (params, float inputs, a sparse embedding gradient) over two SGD steps
  (torch with CUDA needed: with ``CORTEXC_REQUIRE_GPU=1`` its absence fails), and forward + backward inside
  ``with torch.cuda.stream(s):`` (the kernels and copies go on torch's current stream);
- DistributedDataParallel of a CellModule on nccl over 2 GPUs (skipped with fewer): ranks bitwise equal
  after each of 3 SGD steps, and equal to one cpu process stepping with the averaged gradients.

``CORTEXC_GPU_TEST_DEVICE`` runs the same checks on another device (``cuda-emu``, ``cpu``): a way to test this
file without a GPU (the CellModule test then drives the CUDA host path on CPU tensors, ``use_backend``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.runtime.vocab import Vocab
from tests.helpers import EXAMPLES, EXAMPLES_BY_NAME, REPO, load_example, random_inputs

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]

DEVICE = os.environ.get("CORTEXC_GPU_TEST_DEVICE", "cuda")
REQUIRE_GPU = os.environ.get("CORTEXC_REQUIRE_GPU") == "1"
DIMS = {
    "small": {"X": 9, "H": 7, "V": 20, "C": 3},
    "mid": {"X": 40, "H": 33, "V": 50, "C": 5},
}
FORWARD_RTOL = 1e-5
BACKWARD_RTOL = 1e-4
SST_HIDDEN = 256
SST_FORWARD_TREES = 100
SST_BACKWARD_TREES = 20


def _no_gpu_reason() -> str | None:
    """Why device="cuda" cannot run here, or None."""
    if DEVICE != "cuda":
        return None
    try:
        import pycuda.driver as driver
    except ImportError as err:
        return f"PyCUDA is not importable ({err})"
    try:
        driver.init()
        count = driver.Device.count()
    except Exception as err:  # PyCUDA's own error types: no driver, no device
        return f"no usable CUDA driver ({type(err).__name__}: {err})"
    return None if count else "the CUDA driver sees no GPU"


_REASON = _no_gpu_reason()
if _REASON is not None:
    if REQUIRE_GPU:
        pytest.fail(f"CORTEXC_REQUIRE_GPU=1 but {_REASON}", pytrace=False)
    pytest.skip(f"device='cuda' needs a GPU: {_REASON}", allow_module_level=True)


def _relative(actual: np.ndarray, expected: np.ndarray) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.size == 0:
        return 0.0
    return float(np.abs(actual - expected).max() / (np.abs(expected).max() + 1e-30))


def _forest(cell, rng: np.random.Generator) -> Forest:
    """A forest the cell accepts, with more rows per level than one tile and nodes missing arity children."""
    if cell.structure.shares_children:
        return Forest.random_dag(200, rng=rng)
    if cell.arity == 1:
        chain = [7, 2, 1, 40, 17]
        return Forest.concat([Forest.from_parents([i + 1 if i < n - 1 else -1 for i in range(n)]) for n in chain])
    return Forest.random(40, rng=rng, binary=cell.arity == 2, max_children=cell.arity or 5, max_nodes=30)


@pytest.fixture(scope="module")
def packages():
    """Every example compiled once per dims set (into $CORTEXC_CACHE, shared with the benchmark)."""
    built = {}
    for size, dims in DIMS.items():
        for name, path in EXAMPLES_BY_NAME.items():
            built[size, name] = load_example(path, dims)
    return built


@pytest.mark.parametrize("mode", ["split", "persistent", "levels"])
@pytest.mark.parametrize("size", list(DIMS))
@pytest.mark.parametrize("name", list(EXAMPLES_BY_NAME))
def test_cuda_matches_the_interpreter(packages, name, size, mode, rng, monkeypatch):
    """Every launch mode (CORTEXC_CUDA_MODE): split levels by columns with weights in shared memory (the
    default), the persistent kernel by row tiles only, one grid per level; every cell of the file."""
    monkeypatch.setenv("CORTEXC_CUDA_MODE", mode)
    module = packages[size, name]
    for cell in module.__all__:
        _check_cell(getattr(module, cell), f"{name}.{cell}/{size}", rng)


def _check_cell(cls, label: str, rng: np.random.Generator) -> None:
    """One cell on the GPU against the interpreter: forward, then backward from random upstream gradients."""
    gpu, reference = cls(device=DEVICE, seed=2), cls(device="interp", seed=2)
    params = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in reference.params.items()}
    gpu.load_params(params)
    reference.load_params(params)
    forest = _forest(reference.cell, rng)
    inputs = random_inputs(reference.cell, forest, rng)
    out_g, out_r = gpu(forest, grad=True, **inputs), reference(forest, grad=True, **inputs)
    assert set(out_g) == set(out_r)
    errors = {key: _relative(out_g[key], expected) for key, expected in out_r.items()}
    print(f"{label}: {forest.num_nodes} nodes, {forest.num_levels} levels; forward rel err", errors)
    assert max(errors.values()) < FORWARD_RTOL, (label, errors)
    upstream = {key: rng.standard_normal(value.shape).astype(np.float32) for key, value in out_r.items()}
    grads_g, grads_r = gpu.backward(out_g, upstream), reference.backward(out_r, upstream)
    assert set(grads_g) == set(grads_r)
    errors = {f"d{key}": _relative(grads_g[key], expected) for key, expected in grads_r.items()}
    print(f"{label}: backward rel err", errors)
    assert max(errors.values()) < BACKWARD_RTOL, (label, errors)


# ------------------------------------------------------------------ SST


def _sst_dev() -> Path:
    candidates = [Path(os.environ["CORTEXC_SST_DIR"])] if os.environ.get("CORTEXC_SST_DIR") else []
    candidates += [REPO / ".gpu" / "sst", REPO.parent / "shared" / "data" / "sst"]
    for directory in candidates:
        if (directory / "dev.txt").is_file():
            return directory / "dev.txt"
    reason = f"SST dev trees not found (looked in {', '.join(map(str, candidates))}; set CORTEXC_SST_DIR)"
    if REQUIRE_GPU:
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def sst():
    """The dev lines, their vocabulary and the H=256 binary Tree-LSTM on the GPU and in the interpreter."""
    with open(_sst_dev(), encoding="utf-8") as handle:
        lines = [line for line in handle if line.strip()]
    vocab = Vocab.build([Forest.from_ptb(lines)])
    module = cortexc.load(EXAMPLES / "binary_treelstm.cell", H=SST_HIDDEN)  # V: the cell's 21701 (same as bench)
    gpu = module.BinaryTreeLSTM(device=DEVICE, seed=0)
    reference = module.BinaryTreeLSTM(device="interp", seed=0)
    assert len(vocab) <= gpu.params["E"].shape[0]
    return lines, vocab, gpu, reference


@pytest.mark.parametrize("mode", ["split", "persistent", "levels"])
def test_binary_treelstm_forward_on_sst_dev(sst, mode, monkeypatch):
    monkeypatch.setenv("CORTEXC_CUDA_MODE", mode)
    lines, vocab, gpu, reference = sst
    forest = Forest.from_ptb(lines[:SST_FORWARD_TREES])
    ids = vocab.encode(forest)
    out_g, out_r = gpu(forest, word=ids), reference(forest, word=ids)
    errors = {key: _relative(out_g[key], expected) for key, expected in out_r.items()}
    print(
        f"SST dev, {SST_FORWARD_TREES} trees, {forest.num_nodes} nodes, {forest.num_levels} levels, "
        f"H={SST_HIDDEN}, mode {mode}: forward rel err",
        errors,
    )
    assert max(errors.values()) < FORWARD_RTOL, errors
    again = gpu(forest, word=ids)  # params stay on the device; a second call gives the same result
    assert max(_relative(again[key], out_g[key]) for key in out_g) < 1e-6


def test_binary_treelstm_backward_on_sst_dev(sst, rng):
    lines, vocab, gpu, reference = sst
    forest = Forest.from_ptb(lines[:SST_BACKWARD_TREES])
    ids = vocab.encode(forest)
    out_g, out_r = gpu(forest, grad=True, word=ids), reference(forest, grad=True, word=ids)
    upstream = {"logits": rng.standard_normal(out_r["logits"].shape).astype(np.float32)}
    grads_g, grads_r = gpu.backward(out_g, upstream), reference.backward(out_r, upstream)
    assert set(grads_g) == set(grads_r)
    errors = {f"d{key}": _relative(grads_g[key], expected) for key, expected in grads_r.items()}
    print(f"SST dev, {SST_BACKWARD_TREES} trees, H={SST_HIDDEN}: backward rel err", errors)
    assert max(errors.values()) < BACKWARD_RTOL, errors


def test_results_can_stay_on_the_gpu(packages, rng):
    """host=False: on device="cuda" the states and outputs come back as GPUArrays (no copy to the host);
    they hold what the host copy holds."""
    module = packages["small", "treelstm"]
    gpu = module.ChildSumTreeLSTM(device=DEVICE, seed=1)
    forest = _forest(gpu.cell, rng)
    inputs = random_inputs(gpu.cell, forest, rng)
    on_host, kept = gpu(forest, **inputs), gpu(forest, host=False, **inputs)
    assert set(kept) == set(on_host)
    for key, expected in on_host.items():
        value = kept[key]
        if DEVICE == "cuda":
            from pycuda.gpuarray import GPUArray

            assert isinstance(value, GPUArray), key
            value = value.get()
        assert value.shape == expected.shape and np.array_equal(value, expected), key


# ----------------------------------------------------------------------------- cortexc.torch on the GPU


def _torch_device():
    """torch, and the device a CellModule test runs on (skip, or fail under CORTEXC_REQUIRE_GPU, without one)."""
    torch = pytest.importorskip("torch")
    if DEVICE != "cuda":
        return torch, torch.device("cpu")
    if not torch.cuda.is_available():
        reason = f"torch {torch.__version__} sees no CUDA device (built with CUDA {torch.version.cuda})"
        if REQUIRE_GPU:
            pytest.fail(f"CORTEXC_REQUIRE_GPU=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    return torch, torch.device("cuda", 0)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("name", ["binary_treelstm", "treelstm"])
def test_cell_module_on_the_gpu_matches_the_cpu_module(packages, name, sparse, rng):
    """`CellModule.to("cuda")` against the same module on the cpu: forward, the gradients of every param
    and float input, over two SGD steps (so the packed weights are uploaded again after a step)."""
    torch, device = _torch_device()
    from cortexc.torch import CellModule, ForestBatch

    if sparse and name != "binary_treelstm":
        pytest.skip("only the binary Tree-LSTM has an embedding table")
    cls = getattr(packages["mid", name], {"binary_treelstm": "BinaryTreeLSTM", "treelstm": "ChildSumTreeLSTM"}[name])
    on_cpu, on_gpu = CellModule(cls, seed=7, sparse=sparse), CellModule(cls, seed=7, sparse=sparse)
    on_gpu = on_gpu.to(device) if DEVICE == "cuda" else on_gpu.use_backend(DEVICE)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (on_cpu, on_gpu)]
    for _ in range(2):
        forest = _forest(cls.cell, rng)
        inputs = {k: torch.from_numpy(v) for k, v in random_inputs(cls.cell, forest, rng).items()}
        batch = ForestBatch.from_forest(forest)
        results, weights = [], None
        for module, optimizer, where in ((on_cpu, optimizers[0], "cpu"), (on_gpu, optimizers[1], device)):
            given = {k: v.to(where).requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
            out = module(batch, **given)
            if weights is None:
                weights = {k: torch.randn(tuple(v.shape)) for k, v in out.items()}
            optimizer.zero_grad()
            sum((out[k] * w.to(where)).sum() for k, w in weights.items()).backward()
            grads = {n: p.grad.to_dense().cpu() for n, p in module.named_parameters() if p.grad is not None}
            grads |= {k: v.grad.cpu() for k, v in given.items() if v.grad is not None}
            results.append(({k: v.detach().cpu() for k, v in out.items()}, grads))
            optimizer.step()
        (out_cpu, grads_cpu), (out_gpu, grads_gpu) = results
        for key, value in out_cpu.items():
            assert _relative(out_gpu[key].numpy(), value.numpy()) < FORWARD_RTOL, key
        assert set(grads_gpu) == set(grads_cpu)
        for key, value in grads_cpu.items():
            assert _relative(grads_gpu[key].numpy(), value.numpy()) < BACKWARD_RTOL, key
    for name_, p in on_gpu.named_parameters():
        assert p.device == device, name_


@pytest.mark.parametrize("sparse", [False, True])
def test_cell_module_on_a_side_stream_matches_the_cpu_module(packages, sparse, rng):
    """A CellModule on cuda, forward and backward inside ``with torch.cuda.stream(s):`` (a stream of torch's
    pool, which does not synchronise with the default one), against the cpu module. The input is written on
    `s` after a spin of ~50 ms queued there first, and the results are read back on `s`: kernels or copies
    that ran on another stream would race that write (and torch's zeroing of the results) and be wrong.
    Elsewhere (``CORTEXC_GPU_TEST_DEVICE``) the same computation without a stream."""
    import contextlib

    torch, device = _torch_device()
    from cortexc.torch import CellModule, ForestBatch

    cls = packages["mid", "binary_treelstm"].BinaryTreeLSTM
    on_cpu, on_gpu = CellModule(cls, seed=3, sparse=sparse), CellModule(cls, seed=3, sparse=sparse)
    on_gpu = on_gpu.to(device) if DEVICE == "cuda" else on_gpu.use_backend(DEVICE)
    forest = _forest(cls.cell, rng)
    batch = ForestBatch.from_forest(forest)
    word = torch.from_numpy(random_inputs(cls.cell, forest, rng)["word"])
    weights = None
    results = []
    for module, where in ((on_cpu, torch.device("cpu")), (on_gpu, device)):
        on_stream = where.type == "cuda"
        stream = torch.cuda.Stream(where) if on_stream else None
        with torch.cuda.stream(stream) if on_stream else contextlib.nullcontext():
            if on_stream:
                torch.cuda._sleep(50_000_000)  # ~50 ms of spinning queued on s, before the input exists
            given = word.to(where, non_blocking=True) * 1  # written on s, after the spin
            out = module(batch, word=given)
            if weights is None:
                weights = {k: torch.randn(tuple(v.shape)) for k, v in out.items()}
            loss = sum((out[k] * w.to(where)).sum() for k, w in weights.items())
            loss.backward()
            grads = {n: p.grad.to_dense().cpu() for n, p in module.named_parameters()}
            results.append(({k: v.detach().cpu() for k, v in out.items()}, grads))
        if on_stream:
            stream.synchronize()
    (out_cpu, grads_cpu), (out_gpu, grads_gpu) = results
    for key, value in out_cpu.items():
        assert _relative(out_gpu[key].numpy(), value.numpy()) < FORWARD_RTOL, key
    for key, value in grads_cpu.items():
        assert _relative(grads_gpu[key].numpy(), value.numpy()) < BACKWARD_RTOL, key


NCCL_RANK = """
import gc, os, pickle, sys
import numpy as np, torch, torch.distributed as dist
from cortexc.runtime.model import cell_class
from cortexc.torch import CellModule
rank = int(sys.argv[1])
package, shards, out = sys.argv[2], sys.argv[3], sys.argv[4]
torch.cuda.set_device(rank)
dist.init_process_group("nccl", rank=rank, world_size=2)
device = torch.device("cuda", rank)
module = CellModule(cell_class(package, "BinaryTreeLSTM"), seed=100 + rank).to(device)
ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=[rank])
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
with open(shards, "rb") as file:
    steps = pickle.load(file)
history = []
for shard in steps:
    forest, word, labels = shard[rank]
    optimizer.zero_grad()
    logits = ddp(forest, word=torch.as_tensor(word).to(device))["logits"]
    roots = torch.tensor(forest.roots).to(device)
    torch.nn.functional.cross_entropy(logits[roots], torch.as_tensor(labels).to(device)).backward()
    optimizer.step()
    history.append({k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()})
with open(out, "wb") as file:
    pickle.dump(history, file)
del ddp, optimizer, module, logits  # this rank's references to the group go before it does
gc.collect()
dist.barrier()  # both ranks' collectives are done before either tears its communicator down
dist.destroy_process_group()
"""


def test_ddp_on_two_gpus_over_nccl_matches_one_process(packages, rng, tmp_path):
    """DistributedDataParallel(CellModule on cuda:rank) on nccl, 2 ranks built with different seeds: after
    each of 3 SGD steps both ranks hold bitwise the same params, equal (GPU vs CPU tolerance) to one cpu
    process stepping with the two shards' gradients averaged. Skipped with fewer than 2 GPUs."""
    import os
    import pickle
    import socket
    import subprocess
    import sys

    torch, device = _torch_device()
    if DEVICE != "cuda" or torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available():
        pytest.skip("DDP on nccl needs 2 GPUs and torch with NCCL")
    from cortexc.torch import CellModule

    dims = {"V": 30, "X": 6, "H": 5, "C": 3}
    cls = cortexc.load(EXAMPLES / "binary_treelstm.cell", **dims).BinaryTreeLSTM
    reference = CellModule(cls, seed=100)
    steps = []
    for _ in range(3):
        shard = []
        for _rank in range(2):
            forest = Forest.random(3, rng=rng, binary=True, max_children=2, max_nodes=9)
            shard.append((forest, rng.integers(0, dims["V"], forest.num_nodes), rng.integers(0, dims["C"], 3)))
        steps.append(shard)
    with open(tmp_path / "shards.pickle", "wb") as file:
        pickle.dump(steps, file)
    warm = CellModule(cls, seed=100).to(device)  # builds the .cu here, once: the ranks only load it
    forest, word, _ = steps[0][0]
    warm(forest, word=torch.as_tensor(word).to(device))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                NCCL_RANK,
                str(r),
                str(cls._package),
                str(tmp_path / "shards.pickle"),
                str(tmp_path / f"{r}.pickle"),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for process in ranks:
        _, err = process.communicate(timeout=240)
        assert process.returncode == 0, err
    histories = []
    for r in range(2):
        with open(tmp_path / f"{r}.pickle", "rb") as file:
            histories.append(pickle.load(file))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step, shard in enumerate(steps):
        for name in histories[0][step]:
            assert np.array_equal(histories[0][step][name], histories[1][step][name]), (step, name)
        grads = []
        for forest, word, labels in shard:
            reference.zero_grad()
            logits = reference(forest, word=torch.as_tensor(word))["logits"]
            roots = torch.tensor(forest.roots)
            torch.nn.functional.cross_entropy(logits[roots], torch.as_tensor(labels)).backward()
            grads.append({k: p.grad.clone() for k, p in reference.named_parameters()})
        for name, p in reference.named_parameters():
            p.grad = (grads[0][name] + grads[1][name]) / 2
        optimizer.step()
        for name, value in reference.state_dict().items():
            np.testing.assert_allclose(histories[0][step][name], value.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
