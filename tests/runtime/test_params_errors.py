"""Bad params, params files, seeds and upstream gradients: each an `InputError` saying what is wrong."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

import cortexc
from cortexc import Forest
from cortexc.errors import InputError

CELL = "cell P on tree {\n    dim H = 3\n    input x[H]\n    param W[H, H]\n    state h[H]\n"
CELL += "    node { h = tanh(W @ x) }\n}\n"


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    path = tmp_path_factory.mktemp("params") / "p.cell"
    path.write_text(CELL, encoding="utf-8")
    return cortexc.load(path, out_dir=tmp_path_factory.mktemp("params-out"))


def _saved(model, tmp_path):
    path = tmp_path / "w.npz"
    model.save_params(path)
    return path


def _damage(kind: str, path, rng):
    data = path.read_bytes()
    if kind == "random bytes":
        path.write_bytes(rng.integers(0, 256, 600, dtype=np.uint8).tobytes())
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "bad CRC":
        with zipfile.ZipFile(path) as archive:
            info = archive.infolist()[0]
        start = info.header_offset + 30 + len(info.filename) + len(info.extra)
        middle = start + info.compress_size // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])
    elif kind == "a .npy file":
        np.save(path.with_suffix(".npy"), np.zeros((3, 3), np.float32))
        path.write_bytes(path.with_suffix(".npy").read_bytes())
    elif kind == "object arrays":
        np.savez(path, W=np.array([object()] * 9, dtype=object).reshape(3, 3))
    elif kind == "missing":
        path.unlink()
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["random bytes", "truncated", "empty", "bad CRC", "a .npy file", "object arrays", "missing"]
)
def test_a_damaged_params_file_is_an_input_error_naming_it(kind, module, tmp_path, rng):
    model = module.P(device="interp")
    path = _saved(model, tmp_path)
    _damage(kind, path, rng)
    with pytest.raises(InputError) as info:
        model.load_params(path)
    assert str(path) in str(info.value)


def test_a_good_params_file_loads(module, tmp_path):
    model, other = module.P(device="interp", seed=1), module.P(device="interp", seed=2)
    other.load_params(_saved(model, tmp_path))
    assert np.array_equal(other.params["W"], model.params["W"])


@pytest.mark.parametrize("params", [{0: np.zeros((3, 3))}, ["W"], "not a file.npz"])
def test_params_that_are_not_a_mapping_of_names(params, module):
    with pytest.raises(InputError):
        module.P(device="interp").load_params(params)


@pytest.mark.parametrize("seed", [-1, "abc", 1.5, True])
def test_a_seed_must_be_a_non_negative_integer(seed, module):
    with pytest.raises(InputError, match="seed"):
        module.P(device="interp", seed=seed)


@pytest.mark.parametrize("upstream", ["h", {"h": "abc"}, {"h": np.full((2, 3), "a")}])
def test_an_upstream_gradient_that_is_not_numbers(upstream, module):
    model = module.P(device="interp")
    forest = Forest.from_parents([-1, 0])
    out = model(forest, grad=True, x=np.ones((2, 3), np.float32))
    with pytest.raises(InputError):
        model.backward(out, upstream)


@pytest.mark.parametrize("flag", ["grad", "host", "train"])
@pytest.mark.parametrize("value", ["no", 0, 1, None, np.array([True])])
def test_flag_arguments_must_be_bools(module, flag, value):
    """`grad="no"` is truthy in Python: it would silently turn gradient mode on. Every flag argument is
    True or False (NumPy's bools too), else an `InputError` naming it."""
    model = module.P(device="cpu")
    forest = Forest.from_parents([1, -1])
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(InputError, match=rf"{flag} must be True or False, got"):
        model(forest, x=x, **{flag: value})
    model(forest, x=x, **{flag: np.bool_(False)})


def test_sparse_and_fold_must_be_bools(module):
    model = module.P(device="cpu")
    forest = Forest.from_parents([1, -1])
    out = model(forest, grad=True, x=np.zeros((2, 3), np.float32))
    with pytest.raises(InputError, match="sparse must be True or False, got str 'no'"):
        model.backward(out, {"h": np.ones((2, 3), np.float32)}, sparse="no")
    with pytest.raises(InputError, match="fold must be True or False"):
        module.P(device="cpu", fold="off")
    with pytest.raises(InputError, match="fold must be True or False"):
        model.fold = 1
