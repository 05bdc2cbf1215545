"""Tests for cortexc.runtime.vocab: ids, <pad>/<unk>, min_count, encoding, save/load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cortexc.errors import ForestError, InputError
from cortexc.runtime.forest import Forest
from cortexc.runtime.vocab import Vocab

SST_DIR = Path(
    os.environ.get(
        "CORTEXC_SST_DIR",
        Path(__file__).resolve().parents[3] / "shared" / "data" / "sst",
    )
)


def test_ids_by_count_then_first_appearance() -> None:
    vocab = Vocab.build([["b", "a", "c"], ["a", "d", "c"], ["a"]])
    # counts: a=3, b=1, c=2, d=1; ties (b, d) in order of first appearance
    assert vocab.words == ["<pad>", "<unk>", "a", "c", "b", "d"]
    assert len(vocab) == 6
    assert vocab.id("a") == 2 and vocab.id("d") == 5
    assert vocab.word(3) == "c"


def test_pad_and_unk() -> None:
    vocab = Vocab.build([["x", "y"]])
    assert vocab.id("<pad>") == Vocab.PAD_ID == 0
    assert vocab.id("<unk>") == Vocab.UNK_ID == 1
    assert vocab.id("never seen") == 1
    assert vocab.id(None) == 0
    assert "x" in vocab and "z" not in vocab and None not in vocab


def test_min_count_drops_rare_words() -> None:
    corpus = [["a", "b", "a"], ["c", "b", "a"]]
    assert Vocab.build(corpus, min_count=2).words == ["<pad>", "<unk>", "a", "b"]
    assert Vocab.build(corpus, min_count=4).words == ["<pad>", "<unk>"]
    with pytest.raises(InputError, match="min_count"):
        Vocab.build(corpus, min_count=0)


def test_special_tokens_in_corpus_keep_their_ids() -> None:
    vocab = Vocab.build([["<unk>", "a", "<pad>", "a"]])
    assert vocab.words == ["<pad>", "<unk>", "a"]


def test_build_from_forests_and_encode() -> None:
    forest = Forest.from_ptb(["(1 (2 the) (3 (2 cat) (2 the)))", "(0 dog)"])
    vocab = Vocab.build([forest, ["dog", "dog", "emu"]])
    assert vocab.words == ["<pad>", "<unk>", "dog", "the", "cat", "emu"]
    ids = vocab.encode(forest)
    assert ids.dtype == np.int32
    # nodes: the=0, cat=1, the=2, (3 ..)=3, root=4, dog=5
    assert ids.tolist() == [3, 4, 3, 0, 0, 2]
    small = Vocab.build([["the"]])
    assert small.encode(forest).tolist() == [2, 1, 2, 0, 0, 1]
    assert small.encode_words(["the", None, "zebra"]).tolist() == [2, 0, 1]
    assert small.encode_words([]).dtype == np.int32


def test_encode_needs_words() -> None:
    vocab = Vocab.build([["a"]])
    with pytest.raises(ForestError, match="no words"):
        vocab.encode(Forest.from_parents([-1]))
    with pytest.raises(ForestError, match="no words"):
        Vocab.build([Forest.from_parents([-1])])


def test_build_rejects_a_bare_string_item() -> None:
    with pytest.raises(InputError, match="list of words"):
        Vocab.build(["hello", "world"])
    with pytest.raises(InputError, match="not one string"):
        Vocab.build([["a"]]).encode_words("a")


def test_dict_round_trip_through_json() -> None:
    vocab = Vocab.build([["b", "a", "b"], ["caf\u00e9", "8\u00a01\\/2"]])
    data = json.loads(json.dumps(vocab.to_dict()))
    again = Vocab.from_dict(data)
    assert again == vocab
    assert again.words == vocab.words
    assert again.id("caf\u00e9") == vocab.id("caf\u00e9")


def test_from_dict_and_constructor_validate() -> None:
    with pytest.raises(InputError, match="'words' list"):
        Vocab.from_dict({"format": "cortexc.vocab"})
    with pytest.raises(InputError, match="format"):
        Vocab.from_dict({"format": "other", "words": ["<pad>", "<unk>"]})
    with pytest.raises(InputError, match="starts with"):
        Vocab(["a", "<pad>", "<unk>"])
    with pytest.raises(InputError, match="appears twice"):
        Vocab(["<pad>", "<unk>", "a", "a"])
    with pytest.raises(InputError, match="out of range"):
        Vocab(["<pad>", "<unk>"]).word(2)


def test_words_property_is_a_copy() -> None:
    vocab = Vocab.build([["a"]])
    vocab.words.append("b")
    assert vocab.words == ["<pad>", "<unk>", "a"]


@pytest.mark.skipif(not (SST_DIR / "train.txt").is_file(), reason=f"SST data not found in {SST_DIR}")
def test_sst_train_vocab_covers_train_and_pads_internal_nodes() -> None:
    train = Forest.from_ptb_file(SST_DIR / "train.txt")
    vocab = Vocab.build([train])
    ids = vocab.encode(train)
    is_leaf = train.num_children == 0
    assert np.all(ids[~is_leaf] == 0)
    assert np.all(ids[is_leaf] >= 2)  # every train word is known
    assert len(vocab) == 2 + len({w for w in train.words if w is not None})
    assert int(np.sum(ids == vocab.id("8\u00a01\\/2"))) == 1  # U+00A0 word kept whole
