"""GGNN on a random graph: cortexc's compiled graph cell against PyG's GatedGraphConv and hand-written PyTorch.

The model is the gated graph network as `torch_geometric.nn.GatedGraphConv(H, num_layers=T, aggr="add")`
computes it, its step weights tied (every ``weight[t]`` set to one matrix, as in Li et al. 2016):
``h = x`` (x has H features, so PyG's zero padding is nothing), then T times
``m_v = sum over edges u -> v of Wm h_u`` and ``h = GRUCell(m, h)`` (torch's GRUCell: gates r, z, n in that
order, ``h' = (1 - z) * n + z * h``). Three implementations, with the same weights and the same graph:

- ``cortexc``: the cell `CELL` below (``m = Wm @ sum(child.h)``: aggregate, then one GEMM per node),
  compiled for the CPU; ``cortexc_w``, the same cell written ``m = sum(Wm @ child.h)`` as PyG orders it
  (transform, then aggregate; measured at the main size only, the faster of the two goes on to the sweeps);
- ``pyg``: `GatedGraphConv`, the usual way to run a GGNN;
- ``hand``: hand-written PyTorch, ``index_add_`` for the sum of the messages and `torch.nn.GRUCell`.

Before any timing, at a small size, all of them are checked to give the same ``h`` (to 1e-4, absolute) and
the same weight gradients of the training loss (to 1e-4 relative to the largest), so the times compare
equal work. Inference is a forward without gradients; a training step is a forward that keeps what the
backward needs plus the backward of the MSE loss ``mean((h - target)^2)`` (every weight's gradient; no
optimizer step). Times are medians of ``--repeats`` calls, the implementations taking turns (each timed call
follows an untimed call of its own, as `bench_chain.py` does); ratios are peer ms / cortexc ms (above 1:
cortexc is faster). Every implementation runs on ``--threads`` threads (default 2: ``torch.set_num_threads``,
``OMP_NUM_THREADS`` and ``CORTEXC_NUM_THREADS``; cortexc's cap by other processes' load is turned off with
``CORTEXC_ADAPT_THREADS=0`` unless ``--adapt``, so both use the same threads on a shared machine).

Then: where a training step's time goes (the forward that keeps what the backward needs, and the backward
alone, for cortexc and PyG); the ratios over the number of nodes at mean in-degree 5 and over the mean
degree at 20,000 nodes (fewer repeats); and the memory of one training step, each implementation in a
fresh subprocess: the peak resident set after the step (``VmHWM``, the process's ``ru_maxrss``, its peak
reset just before the step through ``/proc/self/clear_refs``) minus the resident set before it (after a
warm-up step on a tiny graph, so the libraries' one-time set-up is not counted).

Usage (from the repository root)::

    python benchmarks/bench_ggnn.py --quick
    python benchmarks/bench_ggnn.py --out benchmarks/results/ggnn.json     # and ggnn.md beside it
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--edges", type=int, default=100_000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sweep-repeats", type=int, default=3)
    parser.add_argument("--sweep-nodes", default="1000,10000,100000", help="node counts at mean degree 5")
    parser.add_argument("--sweep-degrees", default="2,4,8,16,32", help="mean degrees at --sweep-at nodes")
    parser.add_argument("--sweep-at", type=int, default=20_000)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--adapt", action="store_true", help="let cortexc cap its threads by the machine's load")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write JSON here and a markdown table beside it (.md)")
    parser.add_argument("--memory-child", choices=("cortexc", "pyg", "hand"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.edges, args.repeats, args.sweep_repeats = 2000, 10_000, 3, 2
        args.sweep_nodes, args.sweep_degrees, args.sweep_at = "500,2000", "2,8", 2000
    return args


ARGS = _parse()
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)  # before any OpenMP library loads
os.environ["CORTEXC_NUM_THREADS"] = str(ARGS.threads)
if not ARGS.adapt:
    os.environ["CORTEXC_ADAPT_THREADS"] = "0"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cortexc  # noqa: E402
from cortexc import Forest  # noqa: E402

#: the GGNN as PyG's GatedGraphConv computes it (`{M}` is the message line of one of the two variants)
CELL = """\
# GatedGraphConv(H, num_layers=T, aggr="add") with tied step weights: h = x; T times m = sum of Wm h_u over
# in-edges, h = GRUCell(m, h) (torch's gate order r, z, n in W_ih, W_hh, b_ih, b_hh)
cell GGNN on graph(steps = T) {{
    dim H = 64, T = 4
    input x[H]
    param Wm[H, H], W_ih[3*H, H], W_hh[3*H, H], b_ih[3*H], b_hh[3*H]
    state h[H]
    init {{ h = x }}
    node {{
        {M}
        gi = W_ih @ m + b_ih
        gh = W_hh @ prev.h + b_hh
        r = sigmoid(gi[0:H] + gh[0:H])
        z = sigmoid(gi[H:2*H] + gh[H:2*H])
        n = tanh(gi[2*H:3*H] + r * gh[2*H:3*H])
        h = (1 - z) * n + z * prev.h
    }}
}}
"""
VARIANTS = {"cortexc": "m = Wm @ sum(child.h)", "cortexc_w": "m = sum(Wm @ child.h)"}
CHECK_NODES, CHECK_EDGES = 300, 1500


def load_cell(variant: str, work: Path) -> Any:
    source = work / f"ggnn_{variant}.cell"
    source.write_text(CELL.format(M=VARIANTS[variant]))
    return cortexc.load(source, out_dir=work / variant, H=ARGS.hidden, T=ARGS.steps).GGNN


# ------------------------------------------------------------------ the peers


class HandGGNN(torch.nn.Module):
    """The GGNN in plain PyTorch: messages ``Wm h_u`` gathered per edge and summed with ``index_add_``."""

    def __init__(self, hidden: int, steps: int):
        super().__init__()
        self.steps = steps
        self.lin = torch.nn.Linear(hidden, hidden, bias=False)
        self.gru = torch.nn.GRUCell(hidden, hidden)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.steps):
            m = self.lin(h).index_select(0, src)
            h = self.gru(torch.zeros_like(h).index_add_(0, dst, m), h)
        return h


def make_peers(params: dict[str, np.ndarray]) -> tuple[torch.nn.Module, HandGGNN]:
    """PyG's GatedGraphConv and the hand-written GGNN with the cortexc model's params."""
    from torch_geometric.nn import GatedGraphConv

    H, T = ARGS.hidden, ARGS.steps
    conv, hand = GatedGraphConv(H, num_layers=T, aggr="add"), HandGGNN(H, T)
    t = {name: torch.from_numpy(np.array(value)) for name, value in params.items()}
    with torch.no_grad():
        for step in range(T):
            conv.weight[step].copy_(t["Wm"].T)  # PyG: m = x @ weight[t]
        hand.lin.weight.copy_(t["Wm"])
        for gru in (conv.rnn, hand.gru):
            gru.weight_ih.copy_(t["W_ih"])
            gru.weight_hh.copy_(t["W_hh"])
            gru.bias_ih.copy_(t["b_ih"])
            gru.bias_hh.copy_(t["b_hh"])
    return conv, hand


def torch_grads(conv: torch.nn.Module, hand: HandGGNN) -> dict[str, dict[str, np.ndarray]]:
    """The peers' weight gradients under cortexc's names (PyG's tied weights: the sum over the steps)."""
    out = {}
    for name, gru, wm in (("pyg", conv.rnn, conv.weight.grad.sum(0).T), ("hand", hand.gru, hand.lin.weight.grad)):
        out[name] = {
            "Wm": wm.numpy(),
            "W_ih": gru.weight_ih.grad.numpy(),
            "W_hh": gru.weight_hh.grad.numpy(),
            "b_ih": gru.bias_ih.grad.numpy(),
            "b_hh": gru.bias_hh.grad.numpy(),
        }
    return out


# ------------------------------------------------------------------ graphs and steps


class Case:
    """One random graph (edges drawn uniformly, repeats and self-loops allowed) with its inputs, and the
    inference and training-step functions of every implementation on it."""

    def __init__(
        self, models: dict[str, Any], conv: torch.nn.Module, hand: HandGGNN, nodes: int, edges: int, seed: int
    ):
        rng = np.random.default_rng(seed)
        H = ARGS.hidden
        self.nodes, self.edges = nodes, edges
        self.src = rng.integers(0, nodes, edges)
        self.dst = rng.integers(0, nodes, edges)
        self.forest = Forest.from_edges(self.src, self.dst, num_nodes=nodes)
        self.x = rng.standard_normal((nodes, H)).astype(np.float32)
        self.target = rng.standard_normal((nodes, H)).astype(np.float32)
        self.models, self.conv, self.hand = models, conv, hand
        self.tx, self.ttarget = torch.from_numpy(self.x), torch.from_numpy(self.target)
        self.edge_index = torch.from_numpy(np.stack([self.src, self.dst])).long()
        self.tsrc, self.tdst = self.edge_index[0].contiguous(), self.edge_index[1].contiguous()

    # cortexc
    def cortexc_infer(self, variant: str = "cortexc") -> np.ndarray:
        return self.models[variant](self.forest, x=self.x)["h"]

    def cortexc_forward(self, variant: str = "cortexc") -> Any:
        return self.models[variant](self.forest, grad=True, x=self.x)

    def cortexc_backward(self, out: Any, variant: str = "cortexc") -> dict[str, np.ndarray]:
        h = out["h"]
        d_h = (2.0 / h.size) * (h - self.target)  # d mean((h - target)^2) / dh
        return self.models[variant].backward(out, {"h": d_h})

    def cortexc_train(self, variant: str = "cortexc") -> dict[str, np.ndarray]:
        return self.cortexc_backward(self.cortexc_forward(variant), variant)

    # torch
    def torch_infer(self, which: str) -> torch.Tensor:
        with torch.no_grad():
            return self._torch_forward(which)

    def _torch_forward(self, which: str) -> torch.Tensor:
        if which == "pyg":
            return self.conv(self.tx, self.edge_index)
        return self.hand(self.tx, self.tsrc, self.tdst)

    def torch_loss(self, which: str) -> torch.Tensor:
        (self.conv if which == "pyg" else self.hand).zero_grad(set_to_none=True)
        return torch.nn.functional.mse_loss(self._torch_forward(which), self.ttarget)

    def torch_train(self, which: str) -> None:
        self.torch_loss(which).backward()

    def functions(self, variants: list[str]) -> dict[str, Callable[[], Any]]:
        fns: dict[str, Callable[[], Any]] = {}
        for v in variants:
            fns[f"{v}_infer"] = lambda v=v: self.cortexc_infer(v)
        fns["pyg_infer"] = lambda: self.torch_infer("pyg")
        fns["hand_infer"] = lambda: self.torch_infer("hand")
        for v in variants:
            fns[f"{v}_train"] = lambda v=v: self.cortexc_train(v)
        fns["pyg_train"] = lambda: self.torch_train("pyg")
        fns["hand_train"] = lambda: self.torch_train("hand")
        return fns


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median ms per call of each function, taking turns within every repeat; each timed call follows an
    untimed call of the same function (see `bench_chain.interleaved`)."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def split_timings(case: Case, variant: str, repeats: int) -> dict[str, float]:
    """ms of the forward that keeps what the backward needs and of the backward alone (cortexc, PyG)."""
    out, loss = case.cortexc_forward(variant), case.torch_loss("pyg")

    def pyg_backward() -> None:
        nonlocal loss
        loss = case.torch_loss("pyg")  # untimed: a graph to run backward on
        start = time.perf_counter()
        loss.backward()
        backward_s.append(time.perf_counter() - start)

    backward_s: list[float] = []
    fns: dict[str, Callable[[], Any]] = {
        "cortexc_forward_grad": lambda: case.cortexc_forward(variant),
        "pyg_forward_grad": lambda: case.torch_loss("pyg"),
        "cortexc_backward": lambda: case.cortexc_backward(out, variant),
    }
    fwd = interleaved(fns, repeats)
    for _ in range(repeats + 1):
        pyg_backward()
    return {**fwd, "pyg_backward": 1e3 * statistics.median(backward_s[1:])}


# ------------------------------------------------------------------ the check


def check(models: dict[str, Any], conv: torch.nn.Module, hand: HandGGNN) -> dict[str, float]:
    """At a small size: every implementation's h and weight gradients agree (raises SystemExit if not)."""
    case = Case(models, conv, hand, CHECK_NODES, CHECK_EDGES, seed=ARGS.seed + 1)
    expected = case.torch_infer("pyg").numpy()
    report: dict[str, float] = {}
    for name, got in [*((v, case.cortexc_infer(v)) for v in models), ("hand", case.torch_infer("hand").numpy())]:
        report[f"h_max_abs_diff_{name}_vs_pyg"] = float(np.abs(got - expected).max())
    case.torch_train("pyg")
    case.torch_train("hand")
    peers = torch_grads(conv, hand)
    for v in models:
        grads = case.cortexc_train(v)
        for peer, pg in peers.items():
            scale = max(float(np.abs(g).max()) for g in pg.values())
            diff = max(float(np.abs(np.asarray(grads[k]) - pg[k]).max()) for k in pg)
            report[f"grad_max_rel_diff_{v}_vs_{peer}"] = diff / scale
    bad = {k: d for k, d in report.items() if d > 1e-4}
    if bad:
        raise SystemExit(f"the implementations disagree: {bad}")
    return report


# ------------------------------------------------------------------ memory (in a fresh subprocess)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The peak resident set of this process's memory: ``VmHWM``, which `/proc/self/clear_refs` resets.
    (``ru_maxrss`` also counts the memory of the process before its exec, the parent's as it forked: the
    benchmark's own, hundreds of MB, which would hide the step.) ``ru_maxrss`` where there is no VmHWM."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_child(which: str) -> None:
    """One training step of `which` on the main graph, after a warm-up step on a tiny graph; prints JSON.

    The step's peak is the peak resident set after it minus the resident set before it, the peak reset
    to the resident set just before the step (``/proc/self/clear_refs``), so that a higher peak of the set-up
    (imports, compiling, the warm-up) does not hide it."""
    work = Path(tempfile.mkdtemp(prefix="bench_ggnn_mem_"))
    torch.set_num_threads(ARGS.threads)
    models = {"cortexc": load_cell("cortexc", work)(device="cpu", seed=ARGS.seed)}
    conv, hand = make_peers(models["cortexc"].params)
    step = {"cortexc": lambda c: c.cortexc_train(), "pyg": lambda c: c.torch_train("pyg")}
    step["hand"] = lambda c: c.torch_train("hand")
    step[which](Case(models, conv, hand, 50, 250, seed=ARGS.seed + 2))
    case = Case(models, conv, hand, ARGS.nodes, ARGS.edges, seed=ARGS.seed)
    try:  # reset the peak to the present resident set (Linux >= 4.0), so that the peak is the step's own
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    before, peak_before = rss_bytes(), peak_rss_bytes()
    step[which](case)
    peak = peak_rss_bytes()
    result = {"rss_before": before, "peak_before": peak_before, "peak_after": peak, "step_peak": peak - before}
    print(json.dumps({**result, "peak_reset": reset}))


def memory(nodes: int, edges: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for which in ("cortexc", "pyg", "hand"):
        command = [sys.executable, __file__, "--memory-child", which, "--nodes", str(nodes), "--edges", str(edges),
                   "--hidden", str(ARGS.hidden), "--steps", str(ARGS.steps), "--threads", str(ARGS.threads),
                   "--seed", str(ARGS.seed)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        out[which] = json.loads(done.stdout.strip().splitlines()[-1])
        if out[which]["peak_after"] <= out[which]["peak_before"]:
            out[which]["note"] = "the step did not raise the peak: step_peak is a lower bound"
    return out


# ------------------------------------------------------------------ main


def host() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "node": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_geometric": __import__("torch_geometric").__version__,
    }


def ratios(t: dict[str, float], variant: str) -> dict[str, float]:
    return {
        f"{peer}_{what}": t[f"{peer}_{what}"] / t[f"{variant}_{what}"]
        for peer in ("pyg", "hand")
        for what in ("infer", "train")
    }


def main() -> None:
    if ARGS.memory_child:
        memory_child(ARGS.memory_child)
        return
    started, load_start = time.time(), os.getloadavg()[0]
    torch.set_num_threads(ARGS.threads)
    torch.manual_seed(ARGS.seed)
    work = Path(tempfile.mkdtemp(prefix="bench_ggnn_"))
    models = {v: load_cell(v, work)(device="cpu", seed=ARGS.seed) for v in VARIANTS}
    rng = np.random.default_rng(ARGS.seed)
    bound = 1 / np.sqrt(ARGS.hidden)  # torch.nn.GRUCell's init, for every param (biases not zero: checked)
    params = {
        k: rng.uniform(-bound, bound, np.shape(p)).astype(np.float32) for k, p in models["cortexc"].params.items()
    }
    for model in models.values():
        model.load_params(params)
    conv, hand = make_peers(params)
    H, T, th = ARGS.hidden, ARGS.steps, ARGS.threads

    checked = check(models, conv, hand)
    print(f"GGNN H={H} T={T}, {th} threads for every implementation; ms per call (median, taking turns)")
    print(
        f"check at {CHECK_NODES} nodes / {CHECK_EDGES} edges: " + ", ".join(f"{k} {v:.1e}" for k, v in checked.items())
    )

    variants = list(VARIANTS)
    main_case = Case(models, conv, hand, ARGS.nodes, ARGS.edges, seed=ARGS.seed)
    t = interleaved(main_case.functions(variants), ARGS.repeats)
    best = min(variants, key=lambda v: t[f"{v}_train"] + t[f"{v}_infer"])
    print(f"\n{ARGS.nodes} nodes, {ARGS.edges} edges, median of {ARGS.repeats}")
    print(f"{'what':<6} " + " ".join(f"{name:>10}" for name in (*variants, "pyg", "hand")) + "   pyg/cx  hand/cx")
    for what in ("infer", "train"):
        cells = " ".join(f"{t[f'{name}_{what}']:>10.2f}" for name in (*variants, "pyg", "hand"))
        cx = t[f"{best}_{what}"]
        print(f"{what:<6} {cells}  {t[f'pyg_{what}'] / cx:>6.2f}x {t[f'hand_{what}'] / cx:>6.2f}x")
    print(f"(ratios against {best}: {VARIANTS[best]}, the faster variant, used below)")
    split = split_timings(main_case, best, ARGS.repeats)
    print(
        f"training step split: cortexc forward(grad) {split['cortexc_forward_grad']:.2f} + backward "
        f"{split['cortexc_backward']:.2f} ms; PyG forward(grad) + loss {split['pyg_forward_grad']:.2f} + backward "
        f"{split['pyg_backward']:.2f} ms"
    )
    del main_case

    sweeps: dict[str, list[dict[str, Any]]] = {"nodes": [], "degree": []}
    if not ARGS.no_sweep:
        plan = [("nodes", n, 5 * n) for n in map(int, ARGS.sweep_nodes.split(","))]
        plan += [("degree", ARGS.sweep_at, d * ARGS.sweep_at) for d in map(int, ARGS.sweep_degrees.split(","))]
        print(f"\nsweeps ({best}), median of {ARGS.sweep_repeats}: ms cortexc / pyg / hand and ratios")
        print(f"{'nodes':>7} {'edges':>8} {'what':<6} {'cortexc':>9} {'pyg':>9} {'hand':>9}  pyg/cx  hand/cx")
        for kind, n, e in plan:
            case = Case(models, conv, hand, n, e, seed=ARGS.seed + n + e)
            ts = interleaved(case.functions([best]), ARGS.sweep_repeats)
            del case
            sweeps[kind].append({"nodes": n, "edges": e, "degree": e / n, "ms": ts, "ratios": ratios(ts, best)})
            for what in ("infer", "train"):
                cx = ts[f"{best}_{what}"]
                pyg, hd = ts[f"pyg_{what}"], ts[f"hand_{what}"]
                print(f"{n:>7} {e:>8} {what:<6} {cx:>9.2f} {pyg:>9.2f} {hd:>9.2f}  {pyg / cx:>5.2f}x {hd / cx:>6.2f}x")

    mem: dict[str, Any] = {}
    if not ARGS.no_memory:
        mem = memory(ARGS.nodes, ARGS.edges)
        states = (T + 1) * ARGS.nodes * H * 4
        print(
            f"\nmemory of one training step ({ARGS.nodes} nodes, {ARGS.edges} edges; fresh process each, peak RSS "
            f"after the step - RSS before; cortexc keeps (T+1)*N*H floats of states = {states / 2**20:.1f} MiB)"
        )
        for which, m in mem.items():
            print(f"  {which:<8} {m['step_peak'] / 2**20:>8.1f} MiB" + (f"  ({m['note']})" if "note" in m else ""))
        print(
            f"  pyg/cortexc {mem['pyg']['step_peak'] / mem['cortexc']['step_peak']:.2f}x, "
            f"hand/cortexc {mem['hand']['step_peak'] / mem['cortexc']['step_peak']:.2f}x"
        )

    load = os.getloadavg()[0]
    wall = time.time() - started
    print(f"\n1-min load average {load_start:.2f} at the start, {load:.2f} at the end on {os.cpu_count()} CPUs")
    print(f"{wall:.0f} s")
    if ARGS.out:
        result = {
            "host": host(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]), "quick": ARGS.quick,
            "threads": th, "adapt_threads": ARGS.adapt, "H": H, "T": T, "nodes": ARGS.nodes, "edges": ARGS.edges,
            "repeats": ARGS.repeats, "sweep_repeats": ARGS.sweep_repeats, "variants": VARIANTS, "best_variant": best,
            "check": checked, "ms": t, "ratios": ratios(t, best), "split_ms": split, "sweeps": sweeps,
            "memory_bytes": mem, "load_average_start": load_start, "load_average_end": load, "wall_s": wall,
        }  # fmt: skip
        ARGS.out.parent.mkdir(parents=True, exist_ok=True)
        ARGS.out.write_text(json.dumps(result, indent=1) + "\n")
        ARGS.out.with_suffix(".md").write_text(markdown(result))
        print(f"wrote {ARGS.out} and {ARGS.out.with_suffix('.md')}")


def busy(r: dict[str, Any]) -> list[str]:
    """A caution when other processes ran on the machine (1-min load average above half its CPUs)."""
    loads = [r.get("load_average_start", 0.0), r["load_average_end"]]
    if max(loads) <= 0.5 * (r["host"]["cpus"] or 1):
        return []
    return [
        "",
        f"**Caution: the machine was busy (load average up to {max(loads):.1f} on {r['host']['cpus']} CPUs).** Every "
        "implementation ran on its fixed threads while other processes competed for the cores, which slows "
        "each of them by a different factor: the ratios are not those of a quiet machine.",
        *([f"({r['note']}.)"] if r.get("note") else []),
    ]


def markdown(r: dict[str, Any]) -> str:
    h, best = r["host"], r["best_variant"]
    lines = [
        f"# GGNN: cortexc against PyG GatedGraphConv and hand-written PyTorch (H={r['H']}, T={r['T']})",
        "",
        f"Measured {r['date']} on `{h['node']}` ({h['cpu']}, {h['cpus']} CPUs), {r['threads']} threads for every "
        f"implementation, torch {h['torch']}, torch_geometric {h['torch_geometric']}; 1-min load average "
        f"{r.get('load_average_start', float('nan')):.2f} at the start, {r['load_average_end']:.2f} at the end; "
        f"`{r['command']}`. ms per call are medians; ratios are "
        "peer ms / cortexc ms (above 1: cortexc faster), measured in the same run. Training step = forward + "
        "backward of an MSE loss (all weight gradients), no optimizer. cortexc cell: "
        f"`{r['variants'][best]}` (see `benchmarks/bench_ggnn.py`). Outputs and gradients checked equal "
        "(to 1e-4) before timing.",
        *busy(r),
        "",
        f"## {r['nodes']} nodes, {r['edges']} edges (median of {r['repeats']})",
        "",
        "| | "
        + " | ".join(f"{v} (`{r['variants'][v]}`)" for v in r["variants"])
        + " | PyG | hand | PyG / cortexc | hand / cortexc |",
        "|---|" + "---:|" * (len(r["variants"]) + 4),
    ]
    for what in ("infer", "train"):
        cells = " | ".join(f"{r['ms'][f'{v}_{what}']:.2f}" for v in r["variants"])
        lines.append(
            f"| {what} ms | {cells} | {r['ms'][f'pyg_{what}']:.2f} | {r['ms'][f'hand_{what}']:.2f} | "
            f"{r['ratios'][f'pyg_{what}']:.2f}x | {r['ratios'][f'hand_{what}']:.2f}x |"
        )
    s = r["split_ms"]
    lines += [
        "",
        f"Training step split (ms): cortexc forward(grad) {s['cortexc_forward_grad']:.2f}, backward "
        f"{s['cortexc_backward']:.2f}; PyG forward(grad) + loss {s['pyg_forward_grad']:.2f}, backward "
        f"{s['pyg_backward']:.2f}.",
    ]
    for kind, title in (("nodes", "over the number of nodes, mean degree 5"), ("degree", "over the mean degree")):
        rows = r["sweeps"][kind]
        if not rows:
            continue
        lines += [
            "",
            f"## Sweep {title} (median of {r['sweep_repeats']})",
            "",
            "| nodes | edges | cortexc infer ms | PyG / cx infer | hand / cx infer "
            "| cortexc train ms | PyG / cx train | hand / cx train |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            q, ms = row["ratios"], row["ms"]
            lines.append(
                f"| {row['nodes']} | {row['edges']} | {ms[f'{best}_infer']:.2f} | {q['pyg_infer']:.2f}x | "
                f"{q['hand_infer']:.2f}x | {ms[f'{best}_train']:.2f} | {q['pyg_train']:.2f}x | {q['hand_train']:.2f}x |"
            )
    if r["memory_bytes"]:
        m = r["memory_bytes"]
        lines += [
            "",
            f"## Memory of one training step ({r['nodes']} nodes, {r['edges']} edges)",
            "",
            "Each in a fresh process, after a warm-up step on a tiny graph: peak RSS after the step minus RSS before.",
            "",
            "| | MiB | / cortexc |",
            "|---|---:|---:|",
        ]
        for which, v in m.items():
            ratio = v["step_peak"] / m["cortexc"]["step_peak"]
            lines.append(f"| {which} | {v['step_peak'] / 2**20:.1f} | {ratio:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
