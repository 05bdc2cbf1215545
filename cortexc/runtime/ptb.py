"""The PTB bracket reader: one tree per line, ``(label child...)`` or ``(label word)`` (SST's format).

Parsing is vectorised over the whole text (NumPy masks on the UTF-8 bytes,
one regex pass for the atoms, brackets paired by a sort on depth), so a
large treebank loads without Python work per node; malformed input is
reported with its line and column. ``Forest.from_ptb`` documents the format.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from cortexc.errors import ForestError
from cortexc.runtime.forest import Forest

__all__ = ["parse_ptb", "read_ptb", "read_ptb_file"]

# Byte values used by the PTB tokenizer.
_OPEN_BYTE = ord("(")
_CLOSE_BYTE = ord(")")
_SPACE_BYTE = ord(" ")
_NEWLINE_BYTE = ord("\n")

# Token kinds in the PTB token stream; _NONE marks "no token" (line start/end).
_OPEN, _CLOSE, _ATOM, _NONE = 0, 1, 2, -1

# An atom is a label or a word: anything up to an ASCII space, a bracket or a
# line end. Only ASCII space separates tokens (SST words contain U+00A0).
_ATOM_RE = re.compile(r"[^ ()\n]+")

#: one label, and every label of a text joined by line feeds (one regex pass in C over them all)
_LABEL_RE = re.compile(r"-?[0-9]+")
_LABELS_RE = re.compile(r"(?:-?[0-9]+\n)*-?[0-9]+")

_INT32_MIN = int(np.iinfo(np.int32).min)
_INT32_MAX = int(np.iinfo(np.int32).max)


def read_ptb_file(path: str | os.PathLike[str], limit: int | None = None) -> Forest:
    """``read_ptb`` on a UTF-8 file, one bracketed tree per line (its first ``limit`` lines; all if None).
    Every error in the text names the file first (``path: line L, column C: ...``), as a `.cell` error
    does; a missing or unreadable file is Python's own `OSError`, which names it."""
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            lines = list(itertools.islice(handle, limit))
    except UnicodeDecodeError:
        raise ForestError(f"{name}: {_undecodable(path)}") from None
    try:
        return read_ptb(lines)
    except ForestError as err:
        raise type(err)(f"{name}: {err}") from None


def _undecodable(path: str | os.PathLike[str]) -> str:
    """Where a file that failed to decode stops being UTF-8: its line (counted as text mode counts them:
    LF, CRLF or CR) and the byte's offset in that line."""
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        breaks = list(re.finditer(rb"\r\n|\r|\n", data[: err.start]))
        start = breaks[-1].end() if breaks else 0
        return f"line {len(breaks) + 1} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start - start})"
    return "the file changed while it was read: it is UTF-8 text now"


def read_ptb(lines: Iterable[str] | str | bytes) -> Forest:
    """Trees from lines (an iterable, or one str/bytes holding them all); see ``Forest.from_ptb``.

    The lines are normalised (decoded, line ends stripped, embedded newlines
    split) and joined so that one vectorised pass parses them all.
    """
    if isinstance(lines, bytes):
        lines = _decode(lines, "the text")
    if isinstance(lines, str):
        lines = lines.split("\n")
    rows: list[str] = []
    for line in lines:
        if isinstance(line, bytes):
            line = _decode(line, f"line {len(rows) + 1}")
        if not isinstance(line, str):
            raise ForestError(f"line {len(rows) + 1}: expected a str, got {type(line).__name__}")
        line = line.rstrip("\r\n")
        parts = [part.rstrip("\r") for part in line.split("\n")] if "\n" in line else [line]
        rows.extend("" if part.isspace() else part for part in parts)  # a blank line is blank, tabs or not
    return parse_ptb("\n".join(rows))


def _decode(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ForestError(f"{what} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})") from None


def parse_ptb(text: str) -> Forest:
    """Parse PTB text (lines joined by newlines) with vectorised bracket matching.

    Tokens are found on the UTF-8 bytes with NumPy masks; atom strings come
    from one regex pass over the text (the same atom definition, so the i-th
    atom token is the i-th regex match). Depth is a cumsum of +1/-1; sorting
    brackets by (depth, position) makes each open immediately followed by its
    close; the post-order id of a node is the rank of its close bracket, and
    its parent is the last open one level up before its own open.
    """
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    is_open = data == _OPEN_BYTE
    is_close = data == _CLOSE_BYTE
    is_atom_byte = ~(is_open | is_close | (data == _SPACE_BYTE) | (data == _NEWLINE_BYTE))
    atom_start = is_atom_byte.copy()
    atom_start[1:] &= ~is_atom_byte[:-1]
    tok_pos = np.flatnonzero(is_open | is_close | atom_start)
    num_tokens = tok_pos.size
    if num_tokens == 0:
        return Forest.from_parents(np.zeros(0, dtype=np.int64), labels=[], words=[])

    tok_byte = data[tok_pos]
    kind = np.full(num_tokens, _ATOM, dtype=np.int8)
    kind[tok_byte == _OPEN_BYTE] = _OPEN
    kind[tok_byte == _CLOSE_BYTE] = _CLOSE
    newline_pos = np.flatnonzero(data == _NEWLINE_BYTE)
    line = np.searchsorted(newline_pos, tok_pos)  # 0-based line of each token
    atoms = _ATOM_RE.findall(text)
    atom_objects = np.array(atoms, dtype=object)
    is_atom = kind == _ATOM
    atom_rank = np.cumsum(is_atom) - 1  # index into `atoms` for atom tokens
    if len(atoms) != int(is_atom.sum()):  # cannot happen: both use the same atom definition
        raise RuntimeError("PTB tokenizer out of step with its regex")

    first = np.ones(num_tokens, dtype=bool)
    first[1:] = line[1:] != line[:-1]
    last = np.ones(num_tokens, dtype=bool)
    last[:-1] = first[1:]
    delta = (kind == _OPEN).astype(np.int64) - (kind == _CLOSE).astype(np.int64)
    # Bracket depth counted from the start of the text. Up to the first
    # unbalanced line every line starts at depth 0, so it is the depth within
    # the line wherever it matters: at the first error reported, and
    # everywhere when there is no error.
    depth_after = np.cumsum(delta)
    depth_before = depth_after - delta
    prev_kind = np.empty(num_tokens, dtype=np.int8)
    prev_kind[0] = _NONE
    prev_kind[1:] = kind[:-1]
    prev_kind[first] = _NONE
    next_kind = np.empty(num_tokens, dtype=np.int8)
    next_kind[-1] = _NONE
    next_kind[:-1] = kind[1:]
    next_kind[last] = _NONE
    is_label = is_atom & (prev_kind == _OPEN)
    after_label = np.zeros(num_tokens, dtype=bool)
    after_label[1:] = is_label[:-1]
    is_word = is_atom & after_label & ~first

    def token_text(t: int) -> str:
        if kind[t] == _ATOM:
            return repr(atoms[int(atom_rank[t])])
        return "'('" if kind[t] == _OPEN else "')'"

    # (mask, message) pairs in priority order; the earliest flagged token wins.
    checks: list[tuple[np.ndarray, Any]] = [
        (
            first & (kind == _ATOM),
            lambda t: f"text outside brackets: {token_text(t)}",
        ),
        (
            (kind == _CLOSE) & (depth_after < 0),
            lambda t: "unbalanced brackets: ')' closes nothing",
        ),
        (
            ~first & (depth_before == 0) & (kind == _OPEN),
            lambda t: "a second tree starts on the line (one tree per line)",
        ),
        (
            ~first & (depth_before == 0) & (kind == _ATOM),
            lambda t: f"text outside brackets after the tree: {token_text(t)}",
        ),
        (
            (kind == _OPEN) & (next_kind == _OPEN),
            lambda t: "node has no label ('(' followed by '(')",
        ),
        (
            (kind == _OPEN) & (next_kind == _CLOSE),
            lambda t: "empty node '()'",
        ),
        (
            is_label & (next_kind == _CLOSE),
            lambda t: f"node ({atoms[int(atom_rank[t])]}) has neither a word nor children",
        ),
        (
            is_atom & ~is_label & ~is_word & (prev_kind == _ATOM),
            lambda t: f"leaf has more than one word: {token_text(t - 1)} then {token_text(t)}",
        ),
        (
            is_atom & ~is_label & ~is_word & (prev_kind == _CLOSE) & (depth_before > 0),
            lambda t: f"word {token_text(t)} after a child node (a node has a word or children)",
        ),
        (
            is_word & (next_kind == _OPEN),
            lambda t: f"word {token_text(t)} followed by a child node (a node has a word or children)",
        ),
        (
            last & (depth_after > 0),
            lambda t: f"unbalanced brackets: {int(depth_after[t])} '(' not closed by the end of the line",
        ),
    ]
    worst: tuple[int, int] | None = None
    for priority, (mask, _) in enumerate(checks):
        if mask.any():
            candidate = (int(np.argmax(mask)), priority)
            if worst is None or candidate < worst:
                worst = candidate
    if worst is not None:
        token, priority = worst
        where = _ptb_where(text, newline_pos, tok_pos, line, token)
        raise ForestError(where + checks[priority][1](token))

    label_tok = np.flatnonzero(is_label)
    label_text = atom_objects[atom_rank[label_tok]]
    # labels are ASCII integers: int() alone would take "+1", "1_0" and other scripts' digits ("٣")
    label_values = np.zeros(0, np.int64)
    labels_ok = not label_text.size or _LABELS_RE.fullmatch("\n".join(label_text.tolist())) is not None
    if labels_ok and label_text.size:
        try:
            label_values = label_text.astype(np.int64)  # int() on each label, in C
            labels_ok = not np.any((label_values < _INT32_MIN) | (label_values > _INT32_MAX))
        except (ValueError, OverflowError):
            labels_ok = False
    if not labels_ok:  # find the first bad label to report it
        for k, value in enumerate(label_text.tolist()):
            if _LABEL_RE.fullmatch(value) is None:
                problem = "is not an integer (ASCII digits, with '-' for a negative one)"
            else:
                number = int(value) if len(value) <= 12 else _INT32_MAX + 1  # int() refuses 4300 digits
                if _INT32_MIN <= number <= _INT32_MAX:
                    continue
                problem = "does not fit in int32"
            where = _ptb_where(text, newline_pos, tok_pos, line, int(label_tok[k]))
            raise ForestError(where + f"label {value!r} {problem}")

    # Pair brackets: within one depth, opens and closes alternate in position order.
    bracket_tok = np.flatnonzero(~is_atom)
    bracket_depth = np.where(kind[bracket_tok] == _OPEN, depth_after[bracket_tok], depth_before[bracket_tok])
    pairs = bracket_tok[np.lexsort((bracket_tok, bracket_depth))].reshape(-1, 2)
    close_rank = np.cumsum(kind == _CLOSE) - 1
    node_of_token = np.full(num_tokens, -1, dtype=np.int64)
    node_of_token[pairs[:, 0]] = close_rank[pairs[:, 1]]

    open_tok = np.flatnonzero(kind == _OPEN)  # label_tok == open_tok + 1, same order
    open_depth = depth_after[open_tok]
    stride = num_tokens + 1
    keys = open_depth * stride + open_tok
    key_order = np.argsort(keys)
    sorted_keys = keys[key_order]
    before = np.searchsorted(sorted_keys, (open_depth - 1) * stride + open_tok) - 1
    parent_open = open_tok[key_order[np.maximum(before, 0)]]
    num_nodes = open_tok.size
    open_node = node_of_token[open_tok]
    parents = np.empty(num_nodes, dtype=np.int64)
    parents[open_node] = np.where(open_depth > 1, node_of_token[parent_open], -1)
    labels = np.empty(num_nodes, dtype=np.int32)
    labels[open_node] = label_values

    leaf_open = open_tok[kind[open_tok + 2] == _ATOM]
    words = np.full(num_nodes, None, dtype=object)
    words[node_of_token[leaf_open]] = atom_objects[atom_rank[leaf_open + 2]]
    return Forest._from_parent_array(parents, labels, words.tolist())


def _ptb_where(text: str, newline_pos: np.ndarray, tok_pos: np.ndarray, line: np.ndarray, token: int) -> str:
    """``line L, column C: `` for an error at a token (1-based, columns in characters)."""
    line_no = int(line[token])
    start = 0 if line_no == 0 else int(newline_pos[line_no - 1]) + 1
    prefix = text.encode("utf-8")[start : int(tok_pos[token])]
    return f"line {line_no + 1}, column {len(prefix.decode('utf-8')) + 1}: "
