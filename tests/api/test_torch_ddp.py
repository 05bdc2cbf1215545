"""DistributedDataParallel over a CellModule: 2 processes on gloo, 3 optimizer steps.

Each rank builds its module with a different seed (DDP must broadcast rank 0's params) and trains on
its own shard; after every step both ranks hold bitwise the same params, equal (float32 tolerance) to
one process stepping with the two shards' gradients averaged. With ``sparse=True`` the embedding
table is DDP-ignored and the module broadcasts it and averages its sparse gradient itself (checked
with SGD and with Adagrad's sparse update), also over gradient accumulation under ``ddp.no_sync()``
(no collective on the unsynced step; the synced one averages the accumulated gradients). The package
and its `.so` are built here, before the ranks start, so they only load it.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cortexc  # noqa: E402
from cortexc import Forest  # noqa: E402
from cortexc.torch import CellModule, ForestBatch  # noqa: E402
from tests.helpers import EXAMPLES, REPO  # noqa: E402

pytestmark = pytest.mark.slow

DIMS = {"V": 30, "X": 6, "H": 5, "C": 3}
STEPS = 3

RANK = """
import gc, os, pickle, sys
import numpy as np, torch, torch.distributed as dist
from cortexc.runtime.model import cell_class
from cortexc.torch import CellModule, ignore_sparse_tables_for_ddp
rank = int(sys.argv[1])
package, shards, out, sparse, optim = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1", sys.argv[6]
nested = sys.argv[7] == "1"
dist.init_process_group("gloo", rank=rank, world_size=2)
module = CellModule(cell_class(package, "BinaryTreeLSTM"), seed=100 + rank, sparse=sparse)

class Model(torch.nn.Module):  # the cell inside a bigger model: its tables are "cell.E" to DDP
    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def forward(self, forest, **inputs):
        return self.cell(forest, **inputs)

ddp = torch.nn.parallel.DistributedDataParallel(ignore_sparse_tables_for_ddp(Model(module)) if nested else module)
optimizer = getattr(torch.optim, optim)(ddp.parameters(), lr=0.5)
with open(shards, "rb") as file:
    steps = pickle.load(file)
history = []
for shard in steps:
    forest, word, labels = shard[rank]
    optimizer.zero_grad()
    logits = ddp(forest, word=torch.as_tensor(word))["logits"]
    torch.nn.functional.cross_entropy(logits[torch.tensor(forest.roots)], torch.tensor(labels)).backward()
    assert module.E.grad.is_sparse == sparse
    optimizer.step()
    history.append({k: v.detach().numpy().copy() for k, v in module.state_dict().items()})
with open(out, "wb") as file:
    pickle.dump(history, file)
del ddp, optimizer, module, logits  # the module (and its last graph) hold its sparse group: freed in destroy
gc.collect()
dist.barrier()  # both ranks' collectives are done before either shuts its pairs down
dist.destroy_process_group()
# DDP itself keeps references to the default group (a torch leak), whose gloo threads then die in interpreter
# finalization, which can abort ("terminate called without an active exception") after the results are out
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(script: str, argv, results_dir) -> list:
    """Two ranks of `script` (python -c) on gloo over 127.0.0.1 with `argv(rank)`, rank r writing its
    results to `results_dir / f"{r}.pickle"`; those results, by rank."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(_free_port())
    logs = [results_dir / f"{r}.stderr" for r in range(2)]
    ranks = []
    for r in range(2):
        with open(logs[r], "w") as log:  # a file, not a pipe: a rank never blocks on a full pipe
            ranks.append(subprocess.Popen([sys.executable, "-c", script, *argv(r)], env=env, stderr=log))
    deadline = time.monotonic() + 300
    try:  # a failed rank ends the run: its peer would wait in a collective until gloo's 30 min timeout
        while any(p.poll() is None for p in ranks) and not any(p.poll() for p in ranks):
            assert time.monotonic() < deadline, "the ranks ran past 300 s"
            time.sleep(0.05)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    failed = [
        f"rank {r} exited {p.returncode}:\n{log.read_text()}"
        for r, (p, log) in enumerate(zip(ranks, logs))
        if p.returncode
    ]
    assert not failed, "\n".join(failed)
    results = []
    for r in range(2):
        with open(results_dir / f"{r}.pickle", "rb") as file:
            results.append(pickle.load(file))
    return results


def _step_with_averaged_gradients(reference, optimizer, grads: list[dict], history: dict) -> None:
    """One process's step with the two shards' gradients averaged: the params must equal the ranks' own."""
    for name, p in reference.named_parameters():
        p.grad = (grads[0][name] + grads[1][name]) / 2
    optimizer.step()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(history[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    ("sparse", "optim", "nested"), [(False, "SGD", False), (True, "SGD", False), (True, "Adagrad", True)]
)
def test_ddp_on_two_gloo_ranks_matches_one_process_with_averaged_gradients(rng, tmp_path, sparse, optim, nested):
    cls = cortexc.load(EXAMPLES / "binary_treelstm.cell", **DIMS).BinaryTreeLSTM
    reference = CellModule(
        cls, seed=100, sparse=sparse
    )  # rank 0's init: what DDP broadcasts; builds the .so once, here
    steps = []
    for _ in range(STEPS):
        shard = []
        for _rank in range(2):
            forest = Forest.random(3, rng=rng, binary=True, max_children=2, max_nodes=9)
            shard.append((forest, rng.integers(0, DIMS["V"], forest.num_nodes), rng.integers(0, DIMS["C"], 3)))
        steps.append(shard)
    with open(tmp_path / "shards.pickle", "wb") as file:
        pickle.dump(steps, file)
    histories = _run_ranks(
        RANK,
        lambda r: [
            str(r),
            str(cls._package),
            str(tmp_path / "shards.pickle"),
            str(tmp_path / f"{r}.pickle"),
            str(int(sparse)),
            optim,
            str(int(nested)),
        ],
        tmp_path,
    )
    optimizer = getattr(torch.optim, optim)(reference.parameters(), lr=0.5)
    for step, shard in enumerate(steps):
        for name in histories[0][step]:
            assert np.array_equal(histories[0][step][name], histories[1][step][name]), (step, name)
        grads = []
        for forest, word, labels in shard:
            reference.zero_grad()
            logits = reference(forest, word=torch.as_tensor(word))["logits"]
            torch.nn.functional.cross_entropy(logits[torch.tensor(forest.roots)], torch.tensor(labels)).backward()
            grads.append({k: p.grad.clone() for k, p in reference.named_parameters()})
        _step_with_averaged_gradients(reference, optimizer, grads, histories[0][step])


def test_a_sparse_module_in_a_compiled_graph_on_several_ranks_runs_eagerly_or_is_refused(rng, monkeypatch):
    """A compiled graph skips the eager sparse path (dense table gradients, which DDP ignores): on more
    than one rank that would silently diverge, so the forward raises there: `fullgraph=True` refuses it,
    otherwise dynamo runs that forward eagerly, which averages the sparse gradient (several ranks faked
    here; the two-rank tests above run the averaging itself)."""
    import cortexc.torch.ddp as cortexc_ddp

    cls = cortexc.load(EXAMPLES / "binary_treelstm.cell", **DIMS).BinaryTreeLSTM
    forest = Forest.random(2, rng=rng, binary=True, max_children=2, max_nodes=7)
    word = torch.as_tensor(rng.integers(0, DIMS["V"], forest.num_nodes))
    batch = ForestBatch.from_forest(forest)
    synced = []
    monkeypatch.setattr(cortexc_ddp, "_distributed", lambda: True)
    monkeypatch.setattr(CellModule, "_sparse_sync_group", lambda self: synced.append(self) and None)
    torch._dynamo.reset()
    module = CellModule(cls, sparse=True)
    with pytest.raises(Exception, match="sparse=False under torch.compile"):
        torch.compile(module, backend="aot_eager", fullgraph=True)(batch, word=word)
    assert not synced
    torch._dynamo.reset()
    out = torch.compile(module, backend="aot_eager")(batch, word=word)
    out["logits"].sum().backward()
    assert synced == [module] and module.E.grad.is_sparse  # the eager sparse path ran
    torch._dynamo.reset()  # the frame dynamo fell back on is skipped from then on
    dense = torch.compile(CellModule(cls, sparse=False), backend="aot_eager", fullgraph=True)(batch, word=word)
    assert torch.allclose(dense["logits"], out["logits"], rtol=1e-5, atol=1e-6)


ACCUMULATE = """
import gc, os, pickle, sys
import numpy as np, torch, torch.distributed as dist
from cortexc.runtime.model import cell_class
from cortexc.torch import CellModule
rank, package, shards, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", rank=rank, world_size=2)
gathers = []  # every all_gather (the module's sparse averaging; DDP's own buckets are the C++ reducer's)
all_gather = dist.all_gather
dist.all_gather = lambda *args, **kwargs: (gathers.append(1), all_gather(*args, **kwargs))[1]
module = CellModule(cell_class(package, "BinaryTreeLSTM"), seed=100 + rank, sparse=True)
ddp = torch.nn.parallel.DistributedDataParallel(module)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
with open(shards, "rb") as file:
    steps = pickle.load(file)

def micro_batch(forest, word, labels):
    logits = ddp(forest, word=torch.as_tensor(word))["logits"]
    torch.nn.functional.cross_entropy(logits[torch.tensor(forest.roots)], torch.tensor(labels)).backward()

history, counts = [], []
for step in steps:
    optimizer.zero_grad()
    (first, second) = step[rank]
    before = len(gathers)
    with ddp.no_sync():
        micro_batch(*first)
    local = module.E.grad.coalesce()  # after the unsynced backward: this rank's own gradient, nothing averaged
    unsynced = len(gathers) - before
    micro_batch(*second)
    counts.append((unsynced, len(gathers) - before - unsynced))
    history.append(
        {"local_E": (local.indices().numpy().copy(), local.values().numpy().copy()),
         "grad_E": module.E.grad.to_dense().numpy().copy(),
         "grad_W": module.W_iou.grad.numpy().copy()}
    )
    optimizer.step()
    history[-1]["params"] = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
with open(out, "wb") as file:
    pickle.dump((history, counts), file)
del ddp, optimizer, module, local  # the module holds its sparse group: freed in destroy, not at exit
gc.collect()
dist.barrier()  # both ranks' collectives are done before either shuts its pairs down
dist.destroy_process_group()
# DDP itself keeps references to the default group (a torch leak), whose gloo threads then die in interpreter
# finalization, which can abort ("terminate called without an active exception") after the results are out
os._exit(0)
"""


def test_no_sync_accumulation_averages_the_sparse_tables_like_ddp_s_params(rng, tmp_path):
    """Gradient accumulation over 2 micro-batches per rank, the first under ``ddp.no_sync()``: no
    collective runs in the unsynced backward (the table's gradient stays the rank's own), and after the
    synced one the sparse table's gradient, like the dense params', is the average over the ranks of
    each rank's accumulated gradient; after each step both ranks' params are bitwise equal and equal
    (float32 tolerance) to one process stepping with those averaged accumulated gradients."""
    cls = cortexc.load(EXAMPLES / "binary_treelstm.cell", **DIMS).BinaryTreeLSTM
    reference = CellModule(cls, seed=100, sparse=True)  # rank 0's init; builds the .so once, here
    steps = []
    for _ in range(2):
        step = []
        for _rank in range(2):
            micro = []
            for _k in range(2):
                forest = Forest.random(3, rng=rng, binary=True, max_children=2, max_nodes=9)
                micro.append((forest, rng.integers(0, DIMS["V"], forest.num_nodes), rng.integers(0, DIMS["C"], 3)))
            step.append(micro)
        steps.append(step)
    with open(tmp_path / "shards.pickle", "wb") as file:
        pickle.dump(steps, file)
    results = _run_ranks(
        ACCUMULATE,
        lambda r: [str(r), str(cls._package), str(tmp_path / "shards.pickle"), str(tmp_path / f"{r}.pickle")],
        tmp_path,
    )
    for _, counts in results:
        assert counts == [(0, 3)] * len(steps)  # none under no_sync; the synced backward's 3 all-gathers
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for index, step in enumerate(steps):
        ranks_state = [history[index] for history, _ in results]
        for name in ranks_state[0]["params"]:
            assert np.array_equal(ranks_state[0]["params"][name], ranks_state[1]["params"][name]), (index, name)
        assert np.array_equal(ranks_state[0]["grad_E"], ranks_state[1]["grad_E"])
        accumulated = []
        for r, (first, second) in enumerate(step):
            reference.zero_grad()
            for k, (forest, word, labels) in enumerate((first, second)):
                logits = reference(forest, word=torch.as_tensor(word))["logits"]
                torch.nn.functional.cross_entropy(logits[torch.tensor(forest.roots)], torch.tensor(labels)).backward()
                if k == 0:  # the rank's table gradient after its unsynced backward: its own, not averaged
                    own = reference.E.grad.coalesce()
                    rows, values = ranks_state[r]["local_E"]
                    assert np.array_equal(rows, own.indices().numpy())
                    np.testing.assert_allclose(values, own.values().numpy(), rtol=1e-5, atol=1e-6)
            accumulated.append({k: p.grad.to_dense().clone() for k, p in reference.named_parameters()})
        for name, p in reference.named_parameters():
            average = (accumulated[0][name] + accumulated[1][name]) / 2
            p.grad = average.to_sparse() if name == "E" else average
        np.testing.assert_allclose(ranks_state[0]["grad_E"], reference.E.grad.to_dense().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ranks_state[0]["grad_W"], reference.W_iou.grad.numpy(), rtol=1e-5, atol=1e-6)
        optimizer.step()
        for name, value in reference.state_dict().items():
            np.testing.assert_allclose(
                ranks_state[0]["params"][name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name
            )


GRAPH_RANK = """
import os, pickle, sys
import numpy as np, torch, torch.distributed as dist
from cortexc.runtime.model import cell_class
from cortexc.torch import CellModule
rank = int(sys.argv[1])
package, shards, out = sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", rank=rank, world_size=2)
module = CellModule(cell_class(package, "GGNN"), seed=100 + rank)
ddp = torch.nn.parallel.DistributedDataParallel(module)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
with open(shards, "rb") as file:
    steps = pickle.load(file)
history = []
for shard in steps:
    graph, x, rel, labels = shard[rank]
    optimizer.zero_grad()
    logits = ddp(graph, x=torch.as_tensor(x), rel=torch.as_tensor(rel))["logits"]
    torch.nn.functional.cross_entropy(logits, torch.as_tensor(labels)).backward()
    optimizer.step()
    history.append({k: v.detach().numpy().copy() for k, v in module.state_dict().items()})
with open(out, "wb") as file:
    pickle.dump(history, file)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


def test_ddp_trains_a_graph_cell_like_one_process_with_averaged_gradients(rng, tmp_path):
    """The GGNN (graphs with cycles, typed edges) under DDP: both ranks hold bitwise the same params after
    every step, equal to one process stepping with the two shards' gradients averaged."""
    from tests.helpers import random_graph

    cls = cortexc.load(EXAMPLES / "ggnn.cell", X=4, H=5, T=3).GGNN
    reference = CellModule(cls, seed=100)  # rank 0's init, which DDP broadcasts; builds the .so here
    steps = []
    for _ in range(STEPS):
        shard = []
        for _rank in range(2):
            graph = random_graph(int(rng.integers(5, 12)), 8, rng)
            x = rng.standard_normal((graph.num_nodes, 4)).astype(np.float32)
            shard.append((graph, x, rng.integers(0, 3, graph.num_edges), rng.integers(0, 2, graph.num_nodes)))
        steps.append(shard)
    with open(tmp_path / "shards.pickle", "wb") as file:
        pickle.dump(steps, file)
    argv = [str(cls._package), str(tmp_path / "shards.pickle")]
    histories = _run_ranks(GRAPH_RANK, lambda r: [str(r), *argv, str(tmp_path / f"{r}.pickle")], tmp_path)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step, shard in enumerate(steps):
        for name in histories[0][step]:
            assert np.array_equal(histories[0][step][name], histories[1][step][name]), (step, name)
        grads = []
        for graph, x, rel, labels in shard:
            reference.zero_grad()
            logits = reference(graph, x=torch.as_tensor(x), rel=torch.as_tensor(rel))["logits"]
            torch.nn.functional.cross_entropy(logits, torch.as_tensor(labels)).backward()
            grads.append({k: p.grad.clone() for k, p in reference.named_parameters()})
        _step_with_averaged_gradients(reference, optimizer, grads, histories[0][step])
