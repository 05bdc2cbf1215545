"""The package format (`cortexc.runtime.package`): `cell.json` written and read through one set of frozen
dataclasses, with a section per target that holds that target's own program facts, so the order in which
the targets were built changes nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cortexc.errors import OutputError
from cortexc.options import CompileOptions
from cortexc.pipeline import Source, run_stages, write_package
from cortexc.runtime.loader import import_package
from cortexc.runtime.model import load_package
from cortexc.runtime.package import FORMAT_VERSION, PackageSpec
from tests.helpers import EXAMPLES, EXAMPLES_BY_NAME, random_inputs, small_forest
from tests.helpers import digest as _digest


@pytest.mark.parametrize("path", list(EXAMPLES_BY_NAME.values()), ids=list(EXAMPLES_BY_NAME))
def test_cell_json_reads_back_to_what_was_written(path, tmp_path):
    """Every example's `cell.json` parses into the dataclasses and writes back to the same JSON; each
    target's section holds its own program's packed weights, deferred terms, folds and saved arrays."""
    options = CompileOptions.make(targets=("c", "cuda"))
    package = write_package(path.read_text(), str(path), tmp_path, options)
    text = json.loads((package / "cell.json").read_text(encoding="utf-8"))
    spec = PackageSpec.from_json(text)
    assert text["format"] == FORMAT_VERSION and spec.to_json() == text
    assert PackageSpec.from_json(spec.to_json()) == spec
    programs = run_stages(Source(path.read_text(), str(path)), options, until="target")
    for cell, variants in zip(spec.cells, programs):
        for variant in variants:
            section, program = cell.target(variant.target), variant.program
            assert [(w.name, w.params, w.blocks) for w in section.packed] == [
                (w.name, w.params, w.blocks) for w in program.packed
            ]
            assert [(t.param, t.narrow) for t in section.deferred] == [
                (t.param, t.narrow) for t in program.deferred or ()
            ]
            assert [f.name for f in section.folds] == [f.name for f in program.folds]
            assert [v.name for v in section.saved] == [v.name for v in program.saved]
            assert [k["kernel"] for k in section.schedule] == [k.name for k in program.kernels]


@pytest.mark.parametrize("example", ["treelstm", "binary_treelstm"])
def test_the_order_of_the_targets_changes_no_bit(example, tmp_path, rng):
    """`targets=("cuda", "c")` and `("c", "cuda")`: the same results and gradients, bitwise, on cpu and
    cuda-emu (each executor reads its own target's deferred terms and packed weights, whichever came last)."""
    path = EXAMPLES / f"{example}.cell"
    dims = {"X": 8, "H": 6} if example == "treelstm" else {"V": 40, "X": 8, "H": 6}
    digests: dict[str, set[str]] = {"cpu": set(), "cuda-emu": set()}
    sections = []
    for order in (("c", "cuda"), ("cuda", "c")):
        options = CompileOptions.make(dims, targets=order)
        module = import_package(write_package(path.read_text(), str(path), tmp_path / "-".join(order), options))
        cls = getattr(module, module.__all__[0])
        sections.append(dict(cls._spec.targets))
        for device in digests:
            model = cls(device=device, seed=3)
            forest = small_forest(model.signature, np.random.default_rng(5), trees=6, max_nodes=12)
            inputs = random_inputs(model.signature, forest, np.random.default_rng(6))
            out = model(forest, grad=True, **inputs)
            upstream = {k: np.random.default_rng(7).standard_normal(v.shape).astype(np.float32) for k, v in out.items()}
            grads = model.backward(out, upstream)
            digests[device].add(_digest({**dict(out), **{f"d{k}": v for k, v in grads.items()}}))
    assert sections[0] == sections[1]
    assert sections[0]["c"].deferred != sections[0]["cuda"].deferred or example == "binary_treelstm"
    assert all(len(d) == 1 for d in digests.values()), digests


def test_a_damaged_section_is_a_typed_error(tmp_path):
    """A target section missing a field (a hand edit, an old writer): the loader says the package is damaged
    and to compile it again, not a KeyError."""
    path = EXAMPLES / "treernn.cell"
    package = write_package(path.read_text(), str(path), tmp_path, CompileOptions.make(targets=("c",)))
    text = json.loads((package / "cell.json").read_text(encoding="utf-8"))
    del text["cells"][0]["targets"]["c"]["deferred"]
    (package / "cell.json").write_text(json.dumps(text), encoding="utf-8")
    with pytest.raises(OutputError, match=r"is damaged \(KeyError: 'deferred'\): compile it again"):
        load_package(package)
