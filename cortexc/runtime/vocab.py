"""Word vocabularies: map the words of a forest's leaves to embedding rows.

Id 0 is ``<pad>``, which internal nodes (and any node without a word) get, so
that one int32 array of word ids covers every node of a forest; id 1 is
``<unk>`` for words the vocabulary does not know.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from cortexc.errors import ForestError, InputError
from cortexc.runtime.forest import Forest

__all__ = ["Vocab"]

PAD = "<pad>"
UNK = "<unk>"
PAD_ID = 0
UNK_ID = 1


class Vocab:
    """A fixed list of words; a word's id is its position (0 = ``<pad>``, 1 = ``<unk>``)."""

    PAD = PAD
    UNK = UNK
    PAD_ID = PAD_ID
    UNK_ID = UNK_ID

    def __init__(self, words: Sequence[Hashable]) -> None:
        """Take the words by id; the list must start with ``<pad>``, ``<unk>`` and be unique."""
        word_list = list(words)
        if word_list[:2] != [PAD, UNK]:
            raise InputError(f"a vocabulary starts with {PAD!r}, {UNK!r}; got {word_list[:2]!r}")
        index: dict[Any, int] = {}
        for i, word in enumerate(word_list):
            if word is None:
                raise InputError(f"vocabulary entry {i} is None")
            if word in index:
                raise InputError(f"word {word!r} appears twice (ids {index[word]} and {i})")
            index[word] = i
        self._words = word_list
        # None (an internal node's word) maps to <pad>, so encoding is one dict lookup per node.
        self._index: dict[Any, int] = {None: PAD_ID, **index}

    @classmethod
    def build(cls, corpus: Iterable[Iterable[Hashable] | Forest], min_count: int = 1) -> Vocab:
        """Count words over word lists and/or Forests (their leaves' words).

        Words seen at least ``min_count`` times get ids from 2 on, in order of
        decreasing count, ties broken by first appearance, so the same corpus
        always gives the same ids. Literal ``<pad>``/``<unk>`` in the corpus
        keep their special ids.
        """
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise InputError(f"min_count must be an integer >= 1, got {min_count!r}")
        counts: Counter[Any] = Counter()
        for position, item in enumerate(corpus):
            if isinstance(item, Forest):
                if item.words is None:
                    raise ForestError(f"forest {position} of the corpus has no words")
                counts.update(item.words)
            elif isinstance(item, (str, bytes)):
                raise InputError(
                    f"corpus item {position} is a single {type(item).__name__}; "
                    "give a list of words (or a Forest) per item"
                )
            else:
                counts.update(item)
        for special in (None, PAD, UNK):
            counts.pop(special, None)
        # Counter keeps first-appearance order and sorted() is stable.
        kept = [word for word, count in counts.items() if count >= min_count]
        kept.sort(key=lambda word: -counts[word])
        return cls([PAD, UNK, *kept])

    def __len__(self) -> int:
        return len(self._words)

    def __contains__(self, word: object) -> bool:
        return word is not None and word in self._index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and self._words == other._words

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Vocab({len(self)} words)"

    @property
    def words(self) -> list[Hashable]:
        """The words by id (a copy)."""
        return list(self._words)

    def id(self, word: Hashable) -> int:
        """The id of ``word``: ``<unk>``'s when unknown, ``<pad>``'s for None."""
        return self._index.get(word, UNK_ID)

    def word(self, word_id: int) -> Hashable:
        """The word with id ``word_id``."""
        if not 0 <= word_id < len(self._words):
            raise InputError(f"word id {word_id} out of range 0..{len(self._words) - 1}")
        return self._words[word_id]

    def encode_words(self, words: Iterable[Hashable | None]) -> np.ndarray:
        """Ids (int32) of a sequence of words; None gives ``<pad>``, unknown gives ``<unk>``."""
        if isinstance(words, (str, bytes)):
            raise InputError("encode_words takes a sequence of words, not one string")
        # map() with a bound dict.get runs the lookups without a Python frame per word.
        ids = list(map(self._index.get, words, repeat(UNK_ID)))
        return np.array(ids, dtype=np.int32)

    def encode(self, forest: Forest) -> np.ndarray:
        """One id (int32) per node of ``forest``: its word's, ``<pad>`` for internal nodes."""
        if forest.words is None:
            raise ForestError("the forest has no words to encode")
        return self.encode_words(forest.words)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description; ``Vocab.from_dict`` reverses it."""
        return {"format": "cortexc.vocab", "version": 1, "words": list(self._words)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Vocab:
        """The vocabulary ``to_dict`` described."""
        if not isinstance(data, dict) or not isinstance(data.get("words"), list):
            raise InputError("a vocabulary dict needs a 'words' list")
        if data.get("format", "cortexc.vocab") != "cortexc.vocab":
            raise InputError(f"not a cortexc vocabulary: format {data.get('format')!r}")
        return cls(data["words"])
