"""What the CPU runtime keeps between calls to make a call cheap, and why none of it can give stale or
garbage results: the linearization kept on a `Forest` (immutable, its arrays impossible to make writeable
again, dropped when pickled), the weights' pointer tables kept per `set_params`, the /proc/loadavg reading
kept a few ms, and state arrays that are not zero-filled (the C code writes every row but the zero row)."""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

import numpy as np
import pytest

import cortexc.targets.c.executor as cpu
import cortexc.targets.c.memory as cpu_memory
import cortexc.targets.c.threads as cpu_threads
from cortexc import Forest
from cortexc.runtime import linearize as linearize_module
from cortexc.runtime.linearize import linearize
from tests.helpers import (
    SMALL_EXAMPLES,
    load_small_examples,
    random_inputs,
    relative_error,
    small_example_forest,
)
from tests.helpers import chains as _chains
from tests.helpers import first_model as _model


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    return load_small_examples(tmp_path_factory.mktemp("callcache"))


def _forest(key: str, rng: np.random.Generator, size: int = 40) -> Forest:
    return small_example_forest(key, rng, size)


def _assert_equal_results(got, want, label: str) -> None:
    assert got.keys() == want.keys(), label
    for name in want:
        assert (np.asarray(got[name]) == np.asarray(want[name])).all(), f"{label}: {name}"


# ----------------------------------------------------------------------------- the forest's linearization


def test_linearization_is_kept_on_the_forest_and_equals_a_fresh_one(rng):
    forest = Forest.random(8, rng=rng, max_nodes=30)
    first = linearize(forest)
    assert linearize(forest) is first  # computed once
    fresh = linearize_module._linearize(forest)
    for field in ("level_order", "level_ptr", "edge_ptr", "edge_child", "roots"):
        assert (getattr(first, field) == getattr(fresh, field)).all(), field
    assert (first.num_nodes, first.num_levels, first.max_children) == (
        fresh.num_nodes,
        fresh.num_levels,
        fresh.max_children,
    )
    addresses = [getattr(first, f).ctypes.data for f in ("level_order", "level_ptr", "edge_ptr", "edge_child", "roots")]
    assert list(first.addresses) == addresses


def test_kept_arrays_cannot_be_made_writeable(rng):
    """The forest's arrays and its kept linearization's are read-only for good: a cache over them can only
    be stale if they change, and NumPy refuses to make them writeable again."""
    forest = Forest.random(5, rng=rng, max_nodes=20)
    lin = linearize(forest)
    arrays = [forest.child_ptr, forest.child_idx, forest.level, forest.level_order, forest.level_ptr, forest.roots]
    arrays += [lin.level_order, lin.level_ptr, lin.edge_ptr, lin.edge_child, lin.roots]
    for array in arrays:
        assert not array.flags.writeable
        with pytest.raises(ValueError):
            array.flags.writeable = True
        with pytest.raises(ValueError):
            array[...] = 0
    with pytest.raises(AttributeError):
        forest.derived = {}  # type: ignore[misc]


def test_a_pickled_forest_leaves_the_kept_linearization_behind(rng):
    forest = Forest.random(5, rng=rng, max_nodes=20)
    lin = linearize(forest)
    copy = pickle.loads(pickle.dumps(forest))
    assert copy.derived == {}
    for name in ("child_ptr", "child_idx", "level", "level_order", "level_ptr", "roots", "parents"):
        array = getattr(copy, name)
        assert (array == getattr(forest, name)).all()
        assert not array.flags.writeable
        with pytest.raises(ValueError):
            array.flags.writeable = True
    again = linearize(copy)
    assert again is not lin and (again.edge_child == lin.edge_child).all()


def _relabelled(forest: Forest, new_id: np.ndarray) -> Forest:
    """The same forest with node i renamed new_id[i] (children kept in their order)."""
    old_of = np.argsort(new_id)
    counts = forest.num_children[old_of]
    child_idx = np.concatenate([new_id[forest.children(old)] for old in old_of] or [np.zeros(0, np.int64)])
    return Forest(np.r_[0, np.cumsum(counts)], child_idx)


@pytest.mark.parametrize("key", list(SMALL_EXAMPLES))
def test_forests_of_one_shape_in_turn_give_their_own_results(key, modules, rng):
    """Forests with the same node count, levels and edges (one forest with its nodes renamed), run in turn
    on one model, with their inputs renamed alike: each gives the first one's results renamed, whatever
    ran before it, and so do new objects of equal structure: nothing kept for one forest is used for
    another (a cache keyed by shape would give the first forest's rows)."""
    base = _forest(key, rng)
    model = _model(modules[key])
    inputs = random_inputs(model.signature, base, rng)
    want = model(base, **inputs)
    cases = [(base, np.arange(base.num_nodes))]
    for _ in range(2):
        # renamings that keep children before parents (the kept levels' order): shuffle within each level
        new_id = np.empty(base.num_nodes, np.int64)
        order = np.concatenate([rng.permutation(base.level_nodes(k)) for k in range(base.num_levels)])
        new_id[order] = np.arange(base.num_nodes)
        cases.append((_relabelled(base, new_id), new_id))
    for round_ in range(3):
        for index, (forest, new_id) in enumerate(cases):
            if round_ == 2:
                forest = Forest(forest.child_ptr, forest.child_idx)  # equal structure, a new object
            renamed = {}
            for name, value in inputs.items():
                renamed[name] = np.empty_like(value)
                renamed[name][new_id] = value
            got = model(forest, **renamed)
            for name, value in want.items():
                assert relative_error(got[name][new_id], value) < 1e-6, f"round {round_} forest {index}: {name}"


@pytest.mark.parametrize("key", ["lstm", "binary_treelstm", "dagrnn"])
def test_concurrent_calls_on_new_and_shared_forests(key, modules, rng):
    """Threads calling one model at once, each on the shared forests and on forests it builds itself (so
    several threads linearize a new forest at the same time), forward and backward, get the results of
    sequential calls bit for bit."""
    model = _model(modules[key])
    forests = [_forest(key, np.random.default_rng(seed)) for seed in range(4)]
    cases = []
    for forest in forests:
        inputs = random_inputs(model.signature, forest, rng)
        out = model(forest, grad=True, **inputs)
        upstream = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in out.items()}
        cases.append((forest, inputs, upstream, dict(out), model.backward(out, upstream)))
    errors: list[str] = []
    start = threading.Barrier(4)

    def work(thread: int) -> None:
        start.wait()
        for step in range(12):
            forest, inputs, upstream, want, want_grads = cases[(thread + step) % len(cases)]
            if step % 3 == 0:
                forest = Forest(forest.child_ptr, forest.child_idx)  # new: linearized by this call
            out = model(forest, grad=True, **inputs)
            grads = model.backward(out, upstream)
            for name, value in want.items():
                if not (out[name] == value).all():
                    errors.append(f"thread {thread} step {step}: {name}")
            for name, value in want_grads.items():
                if not (grads[name] == value).all():
                    errors.append(f"thread {thread} step {step}: d{name}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:5]


# ----------------------------------------------------------------------------- state arrays not zero-filled


@pytest.mark.parametrize("key", list(SMALL_EXAMPLES))
def test_state_arrays_from_nan_filled_memory_give_the_reference_results(key, modules, rng, monkeypatch):
    """The forward's state arrays (and what a grad=True forward keeps) are not zero-filled: here their
    memory starts as NaN, so a row the C code failed to write, or a "missing child" row N left unzeroed,
    would show as NaN or differ from the interpreter, in the forward and in the backward (which reads the
    kept states and hoisted rows)."""
    filled = []

    def nan_empty(shape, dtype):
        array = np.full(shape, np.nan, dtype)
        filled.append(array)
        return array

    monkeypatch.setattr(cpu_memory, "_empty", nan_empty)
    model = _model(modules[key])
    reference = _model(modules[key], device="interp")
    forest = _forest(key, rng)
    inputs = random_inputs(model.signature, forest, rng)
    expected = reference(forest, grad=True, **inputs)
    inference = model(forest, **inputs)
    for name in (s.name for s in model.signature.states):  # the inference took its states from there
        assert any(np.shares_memory(inference[name], array) for array in filled), name
    taken = len(filled)
    out = model(forest, grad=True, **inputs)
    assert len(filled) > taken  # and so did the kept arrays of this one (`memory.Recycled`)
    for result in (inference, out):
        for name, value in expected.items():
            assert np.isfinite(result[name]).all(), name
            assert relative_error(result[name], value) < 1e-5, name
    upstream = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in expected.items()}
    grads, want = model.backward(out, upstream), reference.backward(expected, upstream)
    for name, value in want.items():
        assert np.isfinite(grads[name]).all(), f"d{name}"
        assert relative_error(grads[name], value) < 1e-5, f"d{name}"


# ----------------------------------------------------------------------------- weights and thread caps


def test_pointer_tables_follow_load_params(modules, rng):
    """The weights' pointer tables are built once per `load_params`: after one, a call reads the new
    weights (a table kept for the old ones would give the old results)."""
    model = _model(modules["lstm"])
    forest = _chains(30, 7)
    x = rng.standard_normal((forest.num_nodes, 32)).astype(np.float32)
    before = model(forest, x=x)["h"]
    params = {name: value * 0.5 for name, value in model.params.items()}
    model.load_params(params)
    after = model(forest, x=x)["h"]
    fresh = _model(modules["lstm"])
    fresh.load_params(params)
    assert (after == fresh(forest, x=x)["h"]).all()
    assert not (after == before).all()


def test_the_load_reading_is_kept_a_few_ms_then_read_again(tmp_path, monkeypatch):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text(f"1.00 1.00 1.00 {cpu_threads.CPUS + 5}/200 1\n")  # every CPU taken by others
    monkeypatch.setattr(cpu_threads, "LOADAVG", str(loadavg))
    monkeypatch.setattr(cpu_threads, "TASKS", str(tmp_path / "no-tasks"))  # own threads unknown: the spin window
    now = [1000.0]
    monkeypatch.setattr(cpu_threads, "time", SimpleNamespace(monotonic=lambda: now[0]))  # the load reading's clock only
    machine = cpu_threads._Machine()
    assert machine.free_cpus() == 1
    loadavg.write_text("1.00 1.00 1.00 1/200 1\n")  # only the caller runs now
    now[0] += cpu_threads.LOAD_REFRESH_S / 2
    assert machine.free_cpus() == 1  # the kept reading
    now[0] += cpu_threads.LOAD_REFRESH_S
    assert machine.free_cpus() == cpu_threads.CPUS  # read again
    now[0] -= 10.0  # a clock that went back is no reason to keep a reading
    loadavg.write_text(f"1.00 1.00 1.00 {cpu_threads.CPUS + 5}/200 1\n")
    assert machine.free_cpus() == 1


def test_a_cpu_seen_free_within_the_window_counts_as_free(tmp_path, monkeypatch):
    """One busy reading (a kernel thread, a short process) does not cap the calls of the next few ms; a
    neighbour busy at every reading of `LOAD_WINDOW_S` does."""
    loadavg = tmp_path / "loadavg"
    monkeypatch.setattr(cpu_threads, "LOADAVG", str(loadavg))
    monkeypatch.setattr(cpu_threads, "TASKS", str(tmp_path / "no-tasks"))
    now = [1000.0]
    monkeypatch.setattr(cpu_threads, "time", SimpleNamespace(monotonic=lambda: now[0]))
    machine = cpu_threads._Machine()
    loadavg.write_text("1.00 1.00 1.00 1/200 1\n")
    assert machine.free_cpus() == cpu_threads.CPUS
    loadavg.write_text(f"1.00 1.00 1.00 {cpu_threads.CPUS + 5}/200 1\n")
    now[0] += 1.5 * cpu_threads.LOAD_REFRESH_S
    assert machine.free_cpus() == cpu_threads.CPUS  # read again, busy, but a CPU was free a moment ago
    assert machine.reading[1] == 1  # (that reading)
    while now[0] < 1000.0 + 2 * cpu_threads.LOAD_REFRESH_S + cpu_threads.LOAD_WINDOW_S:
        now[0] += 1.5 * cpu_threads.LOAD_REFRESH_S
        machine.free_cpus()
    assert machine.free_cpus() == 1  # busy at every reading of the window


def _task(root, tid, state, comm="python"):
    (root / str(tid)).mkdir(parents=True)
    (root / str(tid) / "stat").write_bytes(f"{tid} ({comm}) {state} 1 2 3 4 5".encode())


def test_own_runnable_counts_this_process_s_runnable_threads_but_the_caller(tmp_path, monkeypatch):
    """Threads of this process in state R (an OpenMP worker of a torch op still spinning) are not other
    processes' load; the caller is not counted; a command name with spaces and parentheses parses."""
    import threading

    tasks = tmp_path / "task"
    _task(tasks, threading.get_native_id(), "R")  # the caller
    _task(tasks, 101, "R", comm="omp worker (1) R")
    _task(tasks, 102, "S", comm="a ) S")
    _task(tasks, 103, "R")
    _task(tasks, 104, "D")
    assert cpu_threads.own_runnable(str(tasks)) == 2
    assert cpu_threads.own_runnable(str(tmp_path / "none")) is None
    for tid in range(200, 200 + cpu_threads.OWN_TASKS_MAX):
        _task(tasks, tid, "S")
    assert cpu_threads.own_runnable(str(tasks)) is None  # too many to read at each reading
    assert cpu_threads.own_runnable() is not None  # this machine's own /proc/self/task reads (Linux)


def test_own_runnable_threads_are_not_load(tmp_path, monkeypatch):
    """Every CPU but the caller's taken, by this process's own spinning threads: no cap."""
    import threading

    tasks = tmp_path / "task"
    _task(tasks, threading.get_native_id(), "R")
    for tid in range(cpu_threads.CPUS):
        _task(tasks, 1000 + tid, "R")
    loadavg = tmp_path / "loadavg"
    loadavg.write_text(f"1.00 1.00 1.00 {cpu_threads.CPUS + 1}/200 1\n")
    monkeypatch.setattr(cpu_threads, "LOADAVG", str(loadavg))
    monkeypatch.setattr(cpu_threads, "TASKS", str(tasks))
    assert cpu_threads._Machine().free_cpus() == cpu_threads.CPUS
    loadavg.write_text(f"1.00 1.00 1.00 {2 * cpu_threads.CPUS + 1}/200 1\n")  # and as many of other processes
    assert cpu_threads._Machine().free_cpus() == 1


# ----------------------------------------------------------------------------- recycled memory of kept arrays


@pytest.mark.parametrize("key", ["lstm", "binary_treelstm"])
def test_recycled_kept_memory_gives_fresh_results(key, modules, rng):
    """What a `grad=True` forward keeps (states, hoisted rows, input copies) lives in memory recycled from
    earlier forwards once their results are gone. Here that memory is poisoned with NaN before each
    forward, forests grow and shrink, and a second kept forward runs between a forward and its backward:
    every result and gradient equals a fresh model's bit for bit (a recycled buffer still in use, or one
    whose zero row is not zeroed again, would differ)."""
    model = _model(modules[key])
    executor = model._executor_for_device()
    sizes = [60, 10, 80, 5]
    forests = [_forest(key, np.random.default_rng(seed), size) for seed, size in enumerate(sizes)]
    taken = 0
    for index, forest in enumerate(forests):
        inputs = random_inputs(model.signature, forest, rng)
        fresh = _model(modules[key])
        want = fresh(forest, grad=True, **inputs)
        upstream = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in want.items()}
        want_grads = fresh.backward(want, upstream)
        for pool in executor._recycled.free.values():
            taken += len(pool)
            for flat in pool:
                flat[...] = np.nan
        out = model(forest, grad=True, **inputs)
        other = forests[(index + 1) % len(forests)]
        between = model(other, grad=True, **random_inputs(model.signature, other, rng))  # holds its own memory
        _assert_equal_results(out, want, f"forest {index}")
        grads = model.backward(out, upstream)
        _assert_equal_results(grads, want_grads, f"forest {index} gradients")
        del out, between, grads
    assert taken > 0  # the memory was recycled


@pytest.mark.parametrize("key", list(SMALL_EXAMPLES))
@pytest.mark.parametrize("grad", [False, True])
def test_a_forward_gives_its_results_from_one_fresh_buffer(key, grad, modules, rng):
    """States and outputs (with grad=True, the caller's copies of the states) are views of one new buffer, each
    starting on a 64-byte boundary, so a large forest's results get transparent huge pages instead of a page
    fault per 4 KiB and no vector load of a row spans two cache lines; two calls never share one, and the
    results equal the interpreter's."""
    model = _model(modules[key])
    forest = _forest(key, rng)
    inputs = random_inputs(model.signature, forest, rng)
    first, second = model(forest, grad=grad, **inputs), model(forest, grad=grad, **inputs)
    expected = _model(modules[key], device="interp")(forest, **inputs)
    for result in (first, second):
        arrays = list(result.values())
        base = arrays[0].base
        assert base is not None and all(array.base is base for array in arrays)
        assert all(array.ctypes.data % 64 == 0 for array in arrays)
        for name, value in expected.items():
            assert relative_error(result[name], value) < 1e-5, name
    assert not np.shares_memory(first[next(iter(first))].base, second[next(iter(second))].base)
    _fresh = cpu_memory.fresh_arrays([(3, 5), (7,), (0, 4), (2, 2)])
    assert [a.shape for a in _fresh] == [(3, 5), (7,), (0, 4), (2, 2)]
    assert len({a.base.ctypes.data for a in _fresh if a.size}) == 1
    assert all(a.ctypes.data % 64 == 0 for a in _fresh)


@pytest.mark.parametrize("key", list(SMALL_EXAMPLES))
def test_packed_weights_and_scratch_start_on_a_cache_line(key, modules, rng):
    """The packed GEMM weights (streamed 64 bytes a load) and the per-thread scratch the C code reads start on
    64-byte boundaries: numpy's 16-byte alignment made every panel load of a chain LSTM span two lines."""
    model = _model(modules[key])
    forest = _forest(key, rng)
    model(forest, **random_inputs(model.signature, forest, rng))
    executor = model._executor_for_device()
    params, packed = executor._weights
    assert packed and all(array.ctypes.data % 64 == 0 for array in packed)
    assert all(array.ctypes.data % 64 == 0 for array in executor._scratch.slots.values())
    for shape in [(1,), (3, 5), (1000, 7), 9]:
        array = cpu.aligned_empty(shape)
        assert array.dtype == np.float32 and array.ctypes.data % 64 == 0
        assert array.shape == ((shape,) if isinstance(shape, int) else shape)
    assert cpu.aligned_empty((0, 4)).shape == (0, 4)
