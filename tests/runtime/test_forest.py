"""Tests for cortexc.runtime.forest: constructors, levels, validation, and the real SST data."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortexc.errors import ForestError
from cortexc.runtime.forest import Forest
from cortexc.runtime.linearize import linearize

SST_DIR = Path(
    os.environ.get(
        "CORTEXC_SST_DIR",
        Path(__file__).resolve().parents[3] / "shared" / "data" / "sst",
    )
)
SPLITS = ("train", "dev", "test")
needs_sst = pytest.mark.skipif(
    not all((SST_DIR / f"{split}.txt").is_file() for split in SPLITS),
    reason=f"SST data not found in {SST_DIR} (set CORTEXC_SST_DIR)",
)

STRUCTURE_FIELDS = (
    "child_ptr",
    "child_idx",
    "parent_ptr",
    "parent_idx",
    "parents",
    "num_children",
    "num_parents",
    "roots",
    "level",
    "level_order",
    "level_ptr",
)


def assert_same_structure(a: Forest, b: Forest) -> None:
    """Two forests have identical arrays (values and dtypes) and scalars."""
    for field in STRUCTURE_FIELDS:
        left, right = getattr(a, field), getattr(b, field)
        assert left.dtype == right.dtype, field
        np.testing.assert_array_equal(left, right, err_msg=field)
    for field in ("num_nodes", "num_trees", "num_levels", "max_children", "is_tree"):
        assert getattr(a, field) == getattr(b, field), field


def reference_ptb(lines: list[str]) -> tuple[list[int], list[int], list[str | None]]:
    """A plain stack parser (per token, slow) to check the vectorised one against."""
    parents: list[int] = []
    labels: list[int] = []
    words: list[str | None] = []
    for line in lines:
        tokens = line.replace("(", " ( ").replace(")", " ) ").split(" ")
        tokens = [tok for tok in tokens if tok]
        stack: list[dict] = []
        pos = 0
        while pos < len(tokens):
            tok = tokens[pos]
            if tok == "(":
                stack.append({"label": int(tokens[pos + 1]), "kids": [], "word": None})
                pos += 2
            elif tok == ")":
                node = stack.pop()
                node_id = len(parents)
                parents.append(-1)
                labels.append(node["label"])
                words.append(node["word"])
                for kid in node["kids"]:
                    parents[kid] = node_id
                if stack:
                    stack[-1]["kids"].append(node_id)
                pos += 1
            else:
                stack[-1]["word"] = tok
                pos += 1
    return parents, labels, words


def brute_levels(forest: Forest) -> list[int]:
    """Level of each node by the definition, with a memoised recursion."""

    @functools.cache
    def level(node: int) -> int:
        kids = forest.children(node).tolist()
        return 0 if not kids else 1 + max(level(kid) for kid in kids)

    return [level(node) for node in range(forest.num_nodes)]


def to_nested(forest: Forest, root: int):
    """The nested-tuple form of one tree (leaf value = its word)."""
    kids = forest.children(root).tolist()
    if not kids:
        return forest.words[root]
    return tuple(to_nested(forest, kid) for kid in kids)


def to_networkx(forest: Forest) -> nx.DiGraph:
    """A DiGraph with nodes in forest order and child -> parent edges in child order."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(forest.num_nodes))
    for node in range(forest.num_nodes):
        for kid in forest.children(node).tolist():
            graph.add_edge(kid, node)
    return graph


# --------------------------------------------------------------- from_ptb


def test_ptb_numbering_is_post_order_left_first() -> None:
    forest = Forest.from_ptb("(3 (2 It) (4 (2 's) (1 ok)))")
    # It=0, 's=1, ok=2, (4 ...)=3, root=4
    assert forest.num_nodes == 5
    assert forest.parents.tolist() == [4, 3, 3, 4, -1]
    assert forest.labels.tolist() == [2, 2, 1, 4, 3]
    assert forest.words == ["It", "'s", "ok", None, None]
    assert forest.children(4).tolist() == [0, 3]
    assert forest.children(3).tolist() == [1, 2]
    assert forest.level.tolist() == [0, 0, 0, 1, 2]
    assert forest.roots.tolist() == [4]
    assert forest.num_trees == 1
    assert forest.is_tree


def test_ptb_several_lines_blank_lines_and_input_forms(tmp_path: Path) -> None:
    text = "(1 (2 a) (3 b))\n\n   \n(0 c)\n(4 (1 (2 d) (3 e)) (0 f))\n"
    expected_parents = [2, 2, -1, -1, 6, 6, 8, 8, -1]
    for source in (text, text.splitlines(), text.splitlines(keepends=True)):
        forest = Forest.from_ptb(source)
        assert forest.parents.tolist() == expected_parents
        assert forest.roots.tolist() == [2, 3, 8]
        assert forest.labels.tolist() == [2, 3, 1, 0, 2, 3, 1, 0, 4]
        assert forest.words == ["a", "b", None, "c", "d", "e", None, "f", None]
    crlf = tmp_path / "trees.txt"
    crlf.write_bytes(text.replace("\n", "\r\n").encode("utf-8"))
    with open(crlf, encoding="utf-8", newline="") as handle:  # keeps the \r
        assert Forest.from_ptb(handle).parents.tolist() == expected_parents
    assert Forest.from_ptb_file(crlf).parents.tolist() == expected_parents


def test_ptb_words_are_kept_exactly() -> None:
    words = ["8\u00a01\\/2", "-LRB-", "-RRB-", "``", "''", "don't", "café", "a\tb"]
    line = "(2 " + " ".join(f"(1 {w})" for w in words[:1]) + ")"
    for word in words[1:]:
        line = f"(2 {line} (1 {word}))"
    forest = Forest.from_ptb(line)
    leaves = [w for w in forest.words if w is not None]
    assert leaves == words
    assert "8\u00a01\\/2" in forest.words  # U+00A0 does not split a word


def test_ptb_accepts_multi_digit_and_negative_labels() -> None:
    forest = Forest.from_ptb("(-1 (12 a) (007 b))")
    assert forest.labels.tolist() == [12, 7, -1]
    assert forest.labels.dtype == np.int32


def test_ptb_empty_input_gives_empty_forest() -> None:
    forest = Forest.from_ptb(["", "  "])
    assert forest.num_nodes == 0
    assert forest.num_trees == 0
    assert forest.num_levels == 0
    assert forest.level_ptr.tolist() == [0]
    assert forest.words == []


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("(1 a)\n(2 (3 b) (4 c)", "line 2,", "not closed"),
        ("(1 a))", "line 1,", "closes nothing"),
        ("(1 a)\n\nx (1 a)", "line 3, column 1", "text outside brackets"),
        ("(1 a) b", "line 1, column 7", "text outside brackets"),
        ("(1 a) (2 b)", "line 1, column 7", "second tree"),
        ("((1 a) (2 b))", "line 1, column 1", "no label"),
        ("(1 ())", "line 1, column 4", "empty node"),
        ("()", "line 1, column 1", "empty node"),
        ("(1 a b)", "line 1, column 6", "more than one word"),
        ("(x a)", "line 1, column 2", "not an integer"),
        ("(1.5 a)", "line 1, column 2", "not an integer"),
        ("(99999999999 a)", "line 1, column 2", "int32"),
        ("(1)", "line 1, column 2", "neither a word nor children"),
        ("(1 (2 a) b)", "line 1, column 10", "after a child"),
        ("(1 a (2 b))", "line 1, column 4", "followed by a child"),
        ("(1 a)\n(2 b\n(3 c))", "line 2,", "not closed"),
        ("(1 (2 \u00e9\u00a0x y))", "line 1, column 11", "more than one word"),
    ],
)
def test_ptb_malformed_lines_name_line_and_problem(text: str, where: str, what: str) -> None:
    with pytest.raises(ForestError) as info:
        Forest.from_ptb(text)
    message = str(info.value)
    assert message.startswith(where), message
    assert what in message, message


def test_ptb_matches_reference_parser_on_random_trees() -> None:
    forest = Forest.random(40, rng=3, max_children=4, max_nodes=25)
    lines = [_to_ptb(forest, int(root)) for root in forest.roots]
    parsed = Forest.from_ptb(lines)
    parents, labels, words = reference_ptb(lines)
    assert parsed.parents.tolist() == parents == forest.parents.tolist()
    assert parsed.labels.tolist() == labels == forest.labels.tolist()
    assert parsed.words == words == forest.words


def _to_ptb(forest: Forest, node: int) -> str:
    kids = forest.children(node).tolist()
    inner = forest.words[node] if not kids else " ".join(_to_ptb(forest, k) for k in kids)
    return f"({forest.labels[node]} {inner})"


# ----------------------------------------------------------------- SST


@pytest.fixture(scope="module")
def sst() -> dict[str, Forest]:
    if not all((SST_DIR / f"{split}.txt").is_file() for split in SPLITS):
        pytest.skip(f"SST data not found in {SST_DIR} (set CORTEXC_SST_DIR)")
    return {split: Forest.from_ptb_file(SST_DIR / f"{split}.txt") for split in SPLITS}


@needs_sst
@pytest.mark.parametrize(
    ("split", "num_trees", "root_label_counts"),
    [
        ("train", 8544, [1092, 2218, 1624, 2322, 1288]),
        ("dev", 1101, [139, 289, 229, 279, 165]),
        ("test", 2210, [279, 633, 389, 510, 399]),
    ],
)
def test_sst_splits(sst: dict[str, Forest], split: str, num_trees: int, root_label_counts: list[int]) -> None:
    forest = sst[split]
    assert forest.num_trees == num_trees
    assert forest.is_tree
    assert np.bincount(forest.labels[forest.roots], minlength=5).tolist() == root_label_counts
    assert forest.labels.min() >= 0 and forest.labels.max() <= 4
    # Binary trees: every internal node has exactly two children; words exactly on leaves.
    assert set(np.unique(forest.num_children).tolist()) == {0, 2}
    is_leaf = forest.num_children == 0
    assert [w is not None for w in forest.words] == is_leaf.tolist()
    assert forest.num_nodes == 2 * int(is_leaf.sum()) - num_trees
    # Post-order per line: each tree is a contiguous block ending in its root.
    sizes = np.diff(np.concatenate(([-1], forest.roots)))
    tree_of_node = np.repeat(np.arange(num_trees), sizes)
    has_parent = forest.parents >= 0
    assert np.array_equal(tree_of_node[forest.parents[has_parent]], tree_of_node[has_parent])
    assert np.all(forest.parents[has_parent] > np.flatnonzero(has_parent))


@needs_sst
def test_sst_train_facts_from_readme(sst: dict[str, Forest]) -> None:
    train = sst["train"]
    is_leaf = train.num_children == 0
    assert int(is_leaf.sum()) == 163_563
    assert int((~is_leaf).sum()) == 155_019
    assert train.num_nodes == 318_582
    assert int(train.level.max()) == 29  # deepest tree
    assert train.num_levels == 30
    sizes = np.diff(np.concatenate(([-1], train.roots)))
    tree_of_node = np.repeat(np.arange(train.num_trees), sizes)
    assert int(np.bincount(tree_of_node[is_leaf]).max()) == 52  # longest sentence
    nbsp = [w for w in train.words if w is not None and "\u00a0" in w]
    assert nbsp == ["8\u00a01\\/2", "2\u00a01\\/2", "2\u00a01\\/2"]
    # Brackets inside words are escaped, so no word holds a bracket.
    assert not any("(" in w or ")" in w for w in train.words if w is not None)
    assert "-LRB-" in train.words and "-RRB-" in train.words


@needs_sst
def test_sst_matches_reference_parser(sst: dict[str, Forest]) -> None:
    lines = (SST_DIR / "dev.txt").read_text(encoding="utf-8").splitlines()
    parents, labels, words = reference_ptb(lines)
    dev = sst["dev"]
    assert dev.parents.tolist() == parents
    assert dev.labels.tolist() == labels
    assert dev.words == words
    assert dev.level.tolist() == brute_levels(dev)


@needs_sst
def test_sst_train_parses_fast() -> None:
    """Guards against a per-node Python loop creeping into from_ptb (generous bound)."""
    text = (SST_DIR / "train.txt").read_text(encoding="utf-8")
    start = time.perf_counter()
    forest = Forest.from_ptb(text)
    elapsed = time.perf_counter() - start
    assert forest.num_trees == 8544
    assert elapsed < 3.0, f"from_ptb took {elapsed:.2f}s on SST train"


# ------------------------------------------------- other constructors


def test_from_parents_keeps_indices_and_orders_children() -> None:
    forest = Forest.from_parents([3, 3, -1, -1, 3, 2])
    assert forest.children(3).tolist() == [0, 1, 4]
    assert forest.children(2).tolist() == [5]
    assert forest.roots.tolist() == [2, 3]
    assert forest.level.tolist() == [0, 0, 1, 1, 0, 0]
    assert forest.labels is None and forest.words is None


@pytest.mark.parametrize(
    ("parents", "what"),
    [
        ([1, 2, 0], "cycle through node"),
        ([-1, 2, 3, 1], "cycle through node"),
        ([-1, 0, 2], "node 2 is its own parent"),
        ([-1, 5], "node 1 has parent 5"),
        ([-1, -2], "node 1 has parent -2"),
        ([-1, 0.0], "integers"),
        ([[0, -1]], "1-D"),
    ],
)
def test_from_parents_rejects_bad_input(parents, what: str) -> None:
    with pytest.raises(ForestError, match=what):
        Forest.from_parents(parents)


def test_cycle_error_names_a_node_on_the_cycle() -> None:
    # Nodes 1 and 2 are each other's parent; leaf 3 and node 0 feed into that cycle.
    with pytest.raises(ForestError) as info:
        Forest.from_parents([1, 2, 1, 0])
    message = str(info.value)
    named = int(message.split("cycle through node ")[1].split(" ")[0])
    assert named in (1, 2)
    # "top" (node 0) reads the cycle a <-> b but is not on it; the error must skip it.
    graph = nx.DiGraph()
    graph.add_node("top")
    graph.add_edges_from([("a", "top"), ("a", "b"), ("b", "a")])
    cyclic = Forest.from_networkx(graph)  # a graph, for graph cells: tree and dag cells refuse it when called
    assert cyclic.cycle is not None and cyclic.cycle.startswith("cycle through node '")
    with pytest.raises(ForestError, match=r"^cycle through node '[ab]'.*use a graph cell"):
        cyclic.check_structure(is_dag=True, arity=None)


def test_from_networkx_dag_order_and_labels() -> None:
    graph = nx.DiGraph()
    graph.add_node("s", label=1, word="hi")
    graph.add_node("t", label=2, word="yo")
    graph.add_node("u", label=3)
    graph.add_node("v", label=4)
    graph.add_edge("t", "u")
    graph.add_edge("s", "u")
    graph.add_edge("s", "v")
    graph.add_edge("u", "v")
    forest = Forest.from_networkx(graph, label_attr="label", word_attr="word")
    assert forest.children(2).tolist() == [1, 0]  # predecessor (insertion) order
    assert forest.children(3).tolist() == [0, 2]
    assert forest.parents_of(0).tolist() == [2, 3]
    assert forest.parents.tolist() == [2, 2, 3, -1]
    assert not forest.is_tree
    assert forest.roots.tolist() == [3]
    assert forest.level.tolist() == [0, 0, 1, 2]
    assert forest.labels.tolist() == [1, 2, 3, 4]
    assert forest.words == ["hi", "yo", None, None]


def test_from_networkx_keeps_cycles_for_graph_cells_and_rejects_bad_graphs() -> None:
    cyclic = Forest.from_networkx(nx.DiGraph([("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")]))
    assert cyclic.num_levels == 0 and cyclic.children(0).tolist() == [2, 3]
    with pytest.raises(ForestError, match=r"cycle through node '[abc]'"):
        cyclic.check_structure(is_dag=True, arity=None)
    with pytest.raises(ForestError, match=r"cycle through node '[abc]'.*no levels"):
        linearize(cyclic)
    looped = Forest.from_networkx(nx.DiGraph([("a", "b"), ("b", "b")]))
    assert looped.children(1).tolist() == [0, 1]
    with pytest.raises(ForestError, match=r"'b'.*reads itself"):
        looped.check_structure(is_dag=False, arity=None)
    with pytest.raises(ForestError, match="DiGraph"):
        Forest.from_networkx(nx.Graph([(0, 1)]))
    with pytest.raises(ForestError, match="DiGraph"):
        Forest.from_networkx(nx.MultiDiGraph([(0, 1)]))
    with pytest.raises(ForestError, match="no 'label' attribute"):
        Forest.from_networkx(nx.DiGraph([(0, 1)]), label_attr="label")


def test_from_nested_post_order_and_leaf_values() -> None:
    forest = Forest.from_nested(("a", ("b", 7), ()))
    # a=0, b=1, 7=2, (b 7)=3, ()=4, root=5
    assert forest.parents.tolist() == [5, 3, 3, 5, 5, -1]
    assert forest.words == ["a", "b", 7, None, None, None]
    assert forest.children(5).tolist() == [0, 3, 4]
    assert forest.labels is None
    single = Forest.from_nested("x")
    assert single.num_nodes == 1 and single.words == ["x"]


def test_from_nested_deep_tree_needs_no_recursion() -> None:
    tree: object = "leaf"
    for _ in range(20_000):
        tree = (tree,)
    forest = Forest.from_nested(tree)
    assert forest.num_nodes == 20_001
    assert forest.num_levels == 20_001
    assert forest.parents[:-1].tolist() == list(range(1, 20_001))


def test_from_nested_rejects_self_containing_list() -> None:
    items: list = ["a"]
    items.append(items)
    with pytest.raises(ForestError, match="contains itself"):
        Forest.from_nested(items)


def test_csr_constructor_validates() -> None:
    forest = Forest([0, 0, 0, 2], [0, 1])
    assert forest.parents.tolist() == [2, 2, -1]
    with pytest.raises(ForestError, match="start with 0"):
        Forest([1, 2], [0])
    with pytest.raises(ForestError, match="child_idx has"):
        Forest([0, 0, 2], [0])
    with pytest.raises(ForestError, match="node 1 has child 5"):
        Forest([0, 0, 1], [5])
    with pytest.raises(ForestError, match="node 1 reads itself"):
        Forest([0, 0, 1], [1])
    with pytest.raises(ForestError, match="cycle through node"):
        Forest([0, 1, 2], [1, 0])
    with pytest.raises(ForestError, match="labels must have shape"):
        Forest([0, 0], [], labels=[1, 2])
    with pytest.raises(ForestError, match="one entry per node"):
        Forest([0, 0], [], words=[])


# ------------------------------------------------ round trips and levels


@pytest.mark.parametrize("seed", range(8))
def test_random_forests_round_trip_through_every_constructor(seed: int) -> None:
    gen = np.random.default_rng(seed)
    forest = Forest.random(
        int(gen.integers(1, 30)),
        rng=gen,
        max_children=int(gen.integers(1, 5)),
        min_nodes=int(gen.integers(1, 4)),
        max_nodes=int(gen.integers(4, 40)),
        binary=bool(seed % 3 == 0),
    )
    by_parents = Forest.from_parents(forest.parents, labels=forest.labels, words=forest.words)
    assert_same_structure(forest, by_parents)
    np.testing.assert_array_equal(by_parents.labels, forest.labels)
    assert by_parents.words == forest.words

    assert_same_structure(forest, Forest.from_networkx(to_networkx(forest)))
    assert_same_structure(forest, Forest(forest.child_ptr, forest.child_idx))

    nested = Forest.concat(Forest.from_nested(to_nested(forest, int(r))) for r in forest.roots)
    assert_same_structure(forest, nested)
    assert nested.words == forest.words

    lines = [_to_ptb(forest, int(r)) for r in forest.roots]
    by_ptb = Forest.from_ptb(lines)
    assert_same_structure(forest, by_ptb)
    np.testing.assert_array_equal(by_ptb.labels, forest.labels)


@pytest.mark.parametrize("seed", range(6))
def test_random_dags_round_trip(seed: int) -> None:
    dag = Forest.random_dag(60, rng=seed, max_children=3, max_parents=3)
    assert_same_structure(dag, Forest.from_networkx(to_networkx(dag)))
    assert_same_structure(dag, Forest(dag.child_ptr, dag.child_idx))


@pytest.mark.parametrize("seed", range(6))
def test_levels_match_definition(seed: int) -> None:
    forests = [
        Forest.random(20, rng=seed, max_children=4),
        Forest.random(10, rng=seed, binary=True, max_nodes=60),
        Forest.random_dag(80, rng=seed),
    ]
    for forest in forests:
        assert forest.level.dtype == np.int32
        assert forest.level.tolist() == brute_levels(forest)
        assert forest.num_levels == int(forest.level.max()) + 1
        # level_order: sorted by level, then node id; level_ptr slices it by level.
        keys = list(zip(forest.level[forest.level_order].tolist(), forest.level_order.tolist(), strict=True))
        assert keys == sorted(keys)
        assert sorted(forest.level_order.tolist()) == list(range(forest.num_nodes))
        assert forest.level_ptr[0] == 0 and forest.level_ptr[-1] == forest.num_nodes
        for k in range(forest.num_levels):
            nodes = forest.level_nodes(k)
            assert nodes.size > 0
            assert np.all(forest.level[nodes] == k)


def test_a_million_step_chain_has_its_levels() -> None:
    """Deep structures are linearized without a NumPy step per level (pointer jumping); not timed."""
    n = 1_000_000
    forest = Forest.from_parents(np.append(np.arange(1, n), -1))
    assert forest.num_levels == n
    assert np.array_equal(forest.level, np.arange(n, dtype=np.int32))
    assert np.array_equal(forest.level_order, np.arange(n))
    assert np.array_equal(forest.level_ptr, np.arange(n + 1))


@pytest.mark.parametrize("seed", range(4))
def test_deep_and_bushy_trees_with_shuffled_ids_match_the_definition(seed: int) -> None:
    """Caterpillars, long chains and brooms, numbered at random (parents before or after children)."""
    rng = np.random.default_rng(seed)
    parents: list[int] = []
    for _ in range(6):
        base, size = len(parents), int(rng.integers(1, 300))
        kind = int(rng.integers(0, 3))
        for i in range(size):  # node base + i; its parent among the earlier nodes of this tree
            if i == 0:
                parents.append(-1)
            elif kind == 0:  # chain
                parents.append(base + i - 1)
            elif kind == 1:  # caterpillar: a spine with one leaf per spine node
                parents.append(base + 2 * ((i - 1) // 2))
            else:  # random attachment, deep on average
                parents.append(base + int(rng.integers(max(0, i - 3), i)))
    perm = rng.permutation(len(parents))  # new id of each node
    shuffled = np.full(len(parents), -1)
    for node, parent in enumerate(parents):
        shuffled[perm[node]] = -1 if parent < 0 else perm[parent]
    forest = Forest.from_parents(shuffled)
    assert forest.level.tolist() == brute_levels(forest)


def test_parent_csr_lists_every_reader() -> None:
    dag = Forest.random_dag(50, rng=11)
    readers: dict[int, list[int]] = {node: [] for node in range(dag.num_nodes)}
    for node in range(dag.num_nodes):
        for kid in dag.children(node).tolist():
            readers[kid].append(node)
    for node in range(dag.num_nodes):
        assert dag.parents_of(node).tolist() == sorted(readers[node])
        assert dag.num_parents[node] == len(readers[node])
        expected = min(readers[node]) if readers[node] else -1
        assert dag.parents[node] == expected
    assert dag.roots.tolist() == [n for n in range(dag.num_nodes) if not readers[n]]


def test_random_respects_its_parameters() -> None:
    forest = Forest.random(50, rng=5, max_children=2, min_nodes=3, max_nodes=9)
    sizes = np.diff(np.concatenate(([-1], forest.roots)))
    assert sizes.min() >= 3 and sizes.max() <= 9
    assert forest.max_children <= 2
    assert forest.num_trees == 50
    binary = Forest.random(50, rng=5, binary=True, min_nodes=2, max_nodes=12)
    assert set(np.unique(binary.num_children).tolist()) == {0, 2}
    binary_sizes = np.diff(np.concatenate(([-1], binary.roots)))
    assert binary_sizes.min() >= 3 and binary_sizes.max() <= 11
    assert np.all(binary_sizes % 2 == 1)
    same = Forest.random(50, rng=5, max_children=2, min_nodes=3, max_nodes=9)
    assert_same_structure(forest, same)
    assert same.words == forest.words
    other = Forest.random(50, rng=6, max_children=2, min_nodes=3, max_nodes=9)
    assert other.parents.tolist() != forest.parents.tolist()
    with pytest.raises(ForestError, match="odd"):
        Forest.random(3, rng=0, binary=True, min_nodes=4, max_nodes=4)


def test_random_dag_shares_nodes_within_limits() -> None:
    dag = Forest.random_dag(200, rng=2, max_children=3, max_parents=2)
    assert not dag.is_tree
    assert int(dag.num_parents.max()) == 2
    assert dag.max_children <= 3
    assert [w is not None for w in dag.words] == (dag.num_children == 0).tolist()


# ------------------------------------------------------------ concat


def test_concat_offsets_roots_labels_words() -> None:
    first = Forest.from_ptb("(1 (2 a) (3 b))")
    second = Forest.from_ptb(["(0 c)", "(4 (1 d) (2 e))"])
    both = Forest.concat([first, second])
    assert both.num_nodes == 7
    assert both.parents.tolist() == [2, 2, -1, -1, 6, 6, -1]
    assert both.roots.tolist() == [2, 3, 6]
    assert both.labels.tolist() == [2, 3, 1, 0, 1, 2, 4]
    assert both.words == ["a", "b", None, "c", "d", "e", None]
    assert both.level.tolist() == [0, 0, 1, 0, 0, 0, 1]
    assert_same_structure(both, Forest.from_ptb(["(1 (2 a) (3 b))", "(0 c)", "(4 (1 d) (2 e))"]))

    unlabeled = Forest.concat([first, Forest.from_parents([-1])])
    assert unlabeled.labels is None and unlabeled.words is None
    assert unlabeled.roots.tolist() == [2, 3]

    dag = Forest.random_dag(20, rng=0)
    mixed = Forest.concat([first, dag])
    assert not mixed.is_tree
    np.testing.assert_array_equal(mixed.child_idx[first.child_idx.size :], dag.child_idx + 3)
    assert mixed.level.tolist() == brute_levels(mixed)

    empty = Forest.concat([])
    assert empty.num_nodes == 0 and empty.num_trees == 0


# --------------------------------------------------- structure checks


def test_check_structure_tree_cell_rejects_shared_node() -> None:
    graph = nx.DiGraph()
    graph.add_nodes_from(range(5))  # so that node names and indices agree
    graph.add_edges_from([(0, 3), (1, 3), (0, 2), (2, 4), (3, 4)])
    dag = Forest.from_networkx(graph)
    with pytest.raises(ForestError) as info:
        dag.check_structure(is_dag=False, arity=None, cell_name="TreeLSTM")
    assert str(info.value) == ("node 0 has 2 parents (2, 3) but cell TreeLSTM runs on a tree; use a dag cell")
    dag.check_structure(is_dag=True, arity=2)


def test_check_structure_arity() -> None:
    forest = Forest.from_parents([3, 3, 3, -1, -1, 4])
    with pytest.raises(ForestError, match=r"^node 3 has 3 children but the cell's arity is 2$"):
        forest.check_structure(is_dag=False, arity=2)
    with pytest.raises(ForestError, match="cell Binary's arity is 1"):
        forest.check_structure(is_dag=True, arity=1, cell_name="Binary")
    forest.check_structure(is_dag=False, arity=3)
    forest.check_structure(is_dag=False, arity=None)


# ------------------------------------------------------- misc behaviour


def test_forest_is_immutable_and_copies_inputs() -> None:
    parents = np.array([2, 2, -1], dtype=np.int64)
    forest = Forest.from_parents(parents)
    parents[0] = -1
    assert parents.flags.writeable
    assert forest.parents.tolist() == [2, 2, -1]
    for field in STRUCTURE_FIELDS:
        array = getattr(forest, field)
        assert not array.flags.writeable, field
        with pytest.raises(ValueError):
            array[...] = 0
    with pytest.raises(AttributeError):
        forest.num_nodes = 5  # type: ignore[misc]
    assert not forest.children(2).flags.writeable


def test_dtypes_and_accessors() -> None:
    forest = Forest.random(4, rng=0)
    assert forest.child_ptr.dtype == np.int64 and forest.child_idx.dtype == np.int64
    assert forest.parents.dtype == np.int64 and forest.roots.dtype == np.int64
    assert forest.labels.dtype == np.int32 and forest.level.dtype == np.int32
    expected = f"Forest(num_trees=4, num_nodes={forest.num_nodes}, num_levels={forest.num_levels})"
    assert repr(forest) == expected
    with pytest.raises(IndexError):
        forest.children(forest.num_nodes)
    with pytest.raises(IndexError):
        forest.parents_of(-1)
    with pytest.raises(IndexError):
        forest.level_nodes(forest.num_levels)


# ----------------------------------------------------------------------------- PTB text at its edges


@pytest.mark.parametrize("label", ["+1", "1_0", "٣", "1" * 5000, "２"])
def test_ptb_labels_are_ascii_integers(label):
    with pytest.raises(ForestError, match="label .* (is not an integer|does not fit in int32)") as info:
        Forest.from_ptb([f"(1 (2 a) ({label} b))"])
    assert "line 1" in str(info.value)


def test_ptb_bytes_that_are_not_utf8_are_a_forest_error():
    with pytest.raises(ForestError, match=r"not UTF-8 text \(byte 0xff"):
        Forest.from_ptb(b"(1 \xff)")
    with pytest.raises(ForestError, match=r"line 2 is not UTF-8 text"):
        Forest.from_ptb([b"(1 a)", b"(1 \xff)"])


def test_a_ptb_file_s_errors_name_the_file_its_line_and_column(tmp_path):
    """A damaged treebank file: a bracket error or a byte that is not UTF-8 is a ForestError that names the
    file, then the line (counted as text mode counts lines: LF, CRLF or CR) and the column or byte."""
    path = tmp_path / "trees.txt"
    path.write_bytes(b"(1 (2 a) (3 b))\r\n(1 a)\r(4 (2 x\n")
    with pytest.raises(ForestError) as info:
        Forest.from_ptb_file(path)
    assert str(info.value).startswith(f"{path}: line 3, column 7: unbalanced brackets")  # the line's end
    path.write_bytes(b"(1 a)\r(1 b)\r\n(2 caf\xe9)\n")
    with pytest.raises(ForestError) as info:
        Forest.from_ptb_file(path)
    assert str(info.value) == f"{path}: line 3 is not UTF-8 text (byte 0xe9 at offset 6)"
    with pytest.raises(FileNotFoundError):  # Python's own error, which names the path
        Forest.from_ptb_file(tmp_path / "missing.txt")


def test_a_ptb_file_s_first_lines(tmp_path):
    path = tmp_path / "trees.txt"
    path.write_text("(1 (2 a) (3 b))\n(4 c)\n(1 (2 d\n", encoding="utf-8")
    assert Forest.from_ptb_file(path, limit=2).num_trees == 2  # the bad third line is not read
    assert (
        Forest.from_ptb_file(path, limit=2).parents.tolist()
        == Forest.from_ptb(["(1 (2 a) (3 b))", "(4 c)"]).parents.tolist()
    )
    with pytest.raises(ForestError, match="line 3"):
        Forest.from_ptb_file(path)


@pytest.mark.parametrize("blank", ["", "   ", "\t", " \t \r", "\f"])
def test_ptb_blank_lines_are_skipped_whatever_their_whitespace(blank):
    forest = Forest.from_ptb(["(1 (2 a) (3 b))", blank, "(4 c)"])
    assert forest.num_trees == 2 and forest.num_nodes == 4
    with pytest.raises(ForestError, match="line 3"):  # lines are still counted
        Forest.from_ptb(["(1 a)", blank, "(1 a"])


# ------------------------------------------------------------------ DAG levels (Kahn, then pointer jumping)


def reference_dag_levels(child_ptr: np.ndarray, child_idx: np.ndarray) -> list[int]:
    """Levels by the definition, children first along an explicit-stack depth-first walk (any depth)."""
    n = child_ptr.size - 1
    level = [-1] * n
    for start in range(n):
        stack = [start]
        while stack:
            node = stack[-1]
            if level[node] >= 0:
                stack.pop()
                continue
            kids = child_idx[child_ptr[node] : child_ptr[node + 1]].tolist()
            todo = [kid for kid in kids if level[kid] < 0]
            if todo:
                stack.extend(todo)
            else:
                level[node] = 1 + max((level[kid] for kid in kids), default=-1)
                stack.pop()
    return level


def mixed_dag(rng: np.random.Generator, parts: int, shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    """Children CSR of a DAG of `parts` pieces, each reading earlier nodes: ladders (node i reads i-1 and
    i-2, in either order), windows (k children among the w nodes before), wide layers (one node reading
    many leaves) and shortcuts into earlier pieces; numbered children first or shuffled."""
    kids: list[list[int]] = []
    for _ in range(parts):
        base, size, kind = len(kids), int(rng.integers(1, 120)), int(rng.integers(0, 4))
        for i in range(size):
            node = base + i
            if kind == 0:
                mine = [node - d for d in (1, 2) if node - d >= base]
                mine = mine[::-1] if rng.integers(0, 2) else mine
            elif kind == 1:
                w = int(rng.integers(1, 8))
                low = max(0, node - w)
                mine = sorted(set(rng.integers(low, node, int(rng.integers(0, 4))).tolist())) if node > low else []
            elif kind == 2:
                mine = [] if i < size - 1 else list(range(base, node))
            else:
                mine = sorted(set(rng.integers(0, node, int(rng.integers(0, 3))).tolist())) if node else []
            kids.append([int(k) for k in mine])
    n = len(kids)
    perm = rng.permutation(n) if shuffle else np.arange(n)  # new id of each node
    new_kids: list[list[int]] = [[] for _ in range(n)]
    for node, mine in enumerate(kids):
        new_kids[perm[node]] = [int(perm[k]) for k in rng.permutation(mine).tolist()] if shuffle else mine
    counts = np.array([len(k) for k in new_kids], dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return ptr, np.array([k for mine in new_kids for k in mine], dtype=np.int64)


@given(seed=st.integers(0, 2**32 - 1), parts=st.integers(1, 8), shuffle=st.booleans())
@settings(max_examples=60, deadline=None)
def test_dag_levels_match_the_definition_on_deep_and_wide_mixes(seed: int, parts: int, shuffle: bool) -> None:
    """Kahn, pointer jumping alone and the switch between them (forced early) all give the definition."""
    from cortexc.runtime.forest import _dag_levels, _pointer_levels

    ptr, idx = mixed_dag(np.random.default_rng(seed), parts, shuffle)
    expected = reference_dag_levels(ptr, idx)
    forest = Forest(ptr, idx)
    assert forest.level.tolist() == expected
    pointer = _pointer_levels(ptr, idx, max_rounds=10_000)
    assert pointer is not None and pointer.tolist() == expected
    early = _dag_levels(ptr, idx, forest.num_children, forest.parent_ptr, forest.parent_idx, share=0.0)
    assert early.tolist() == expected


def ladder_dag(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Node i reads i-2 and i-1: a chain-shaped DAG as deep as it is long, every node shared."""
    counts = np.minimum(np.arange(n), 2)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    idx = np.empty(int(ptr[-1]), np.int64)
    idx[:1] = 0
    i = np.arange(2, n)
    idx[1::2], idx[2::2] = i - 2, i - 1
    return ptr, idx


def test_a_million_node_chain_shaped_dag_has_its_levels() -> None:
    """A DAG as deep as it is long is leveled without a NumPy step per level (pointer jumping); not timed."""
    n = 1_000_000
    forest = Forest(*ladder_dag(n))
    assert not forest.is_tree and forest.num_levels == n
    assert np.array_equal(forest.level, np.arange(n, dtype=np.int32))


def test_a_cycle_above_a_deep_dag_is_named() -> None:
    """Pointer jumping cannot settle on a cycle; Kahn then names a node on it, as for a shallow DAG."""
    from cortexc.runtime.forest import _pointer_levels

    ptr, idx = ladder_dag(3000)
    counts = np.diff(ptr)
    counts[100] += 1  # node 100 also reads node 2000, which reads node 100 through the ladder
    kids = np.insert(idx, ptr[101], 2000)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    assert _pointer_levels(ptr, kids, max_rounds=50) is None
    with pytest.raises(ForestError, match="cycle through node") as info:
        Forest(ptr, kids)
    named = int(str(info.value).split("cycle through node ")[1].split(" ")[0])
    assert 100 <= named <= 2000


def test_a_deep_dag_above_a_wide_level_has_its_levels() -> None:
    """200k leaves, then a 20k-node ladder reading the first: Kahn sees the DAG turn deep and hands over."""
    wide, deep = 200_000, 20_000
    ptr, idx = ladder_dag(deep)
    counts = np.concatenate([np.zeros(wide, np.int64), np.diff(ptr)])
    counts[wide] += 1  # the ladder's first node reads leaf 0
    forest = Forest(np.concatenate([[0], np.cumsum(counts)]), np.concatenate([[0], idx + wide]))
    expected = np.concatenate([np.zeros(wide, np.int32), np.arange(1, deep + 1, dtype=np.int32)])
    assert np.array_equal(forest.level, expected)
