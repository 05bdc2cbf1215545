"""Text -> AST: the Lark LALR parser and a transformer to frozen dataclasses.

Syntax errors become `CellSyntaxError` at the offending token, with the set of
tokens the grammar would have accepted written as the user would type them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import lark
from lark import Token, Transformer, v_args

from cortexc.errors import CellSyntaxError, SourceError, SourceLoc
from cortexc.frontend import ast

#: the longest number literal (few enough digits for `int()`)
MAX_NUMBER_LENGTH = 100

#: how a terminal that is not a fixed string is described in messages
_TERMINAL_WORDS = {"NAME": "a name", "NUMBER": "a number", "$END": "end of file"}


@functools.cache
def _lark() -> lark.Lark:
    grammar = resources.files("cortexc.grammars").joinpath("cell.lark").read_text(encoding="utf-8")
    return lark.Lark(grammar, start="module", parser="lalr", lexer="basic", maybe_placeholders=True)


def read_source(path: str | os.PathLike[str]) -> str:
    """The text of a `.cell` file: UTF-8 (a byte-order mark is skipped), else a located `SourceError`."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise SourceError(f"cannot read {os.fspath(path)}: {err.strerror or err}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        start = err.start
        line = data.count(b"\n", 0, start) + 1
        col = start - (data.rfind(b"\n", 0, start) + 1) + 1
        text = data.split(b"\n")[line - 1].decode("utf-8", "replace")
        raise SourceError(
            f"the file is not UTF-8 text (byte 0x{data[start]:02x})", SourceLoc(os.fspath(path), line, col, text)
        ) from None


def source_lines(source: str) -> list[str]:
    """The lines as the lexer counts them: only a line feed ends a line (CR LF and a lone CR are made line
    feeds first); form feeds, NEL and the Unicode separators do not (`str.splitlines` would split there, and
    the echoed line would not be the one the location names)."""
    return source.split("\n")


def normalize_line_ends(source: str) -> str:
    """CR LF and lone CR (old Mac files) become LF, so line numbers agree with every editor; a leading
    byte-order mark goes."""
    return source.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def parse(source: str, file: str = "<string>") -> ast.Module:
    """Parse a whole `.cell` file into an `ast.Module` (raises `CellSyntaxError`)."""
    original = source
    source = normalize_line_ends(source)
    lines = source_lines(source)

    def loc(line: int, col: int) -> SourceLoc:
        text = lines[line - 1] if 0 < line <= len(lines) else ""
        return SourceLoc(file, line, col, text)

    try:
        tree = _lark().parse(source)
    except lark.exceptions.UnexpectedCharacters as err:
        pos = err.pos_in_stream
        char = source[pos] if pos is not None and pos < len(source) else ""
        raise CellSyntaxError(f"unexpected character {char!r}", loc(err.line, err.column)) from None
    except lark.exceptions.UnexpectedToken as err:
        where = _end_loc(lines, file) if err.token.type == "$END" else loc(err.line, err.column)
        message = _slip(source, err.token) or _unexpected_message(err.token, err.expected)
        raise CellSyntaxError(message, where) from None
    except lark.exceptions.UnexpectedEOF as err:
        raise CellSyntaxError(_unexpected_message(None, err.expected), _end_loc(lines, file)) from None
    _check_nesting(tree, loc)
    try:
        cells = _ToAst(loc).transform(tree)
    except lark.exceptions.VisitError as err:  # lark wraps what a transformer method raises
        if isinstance(err.orig_exc, CellSyntaxError):
            raise err.orig_exc from None
        raise
    return ast.Module(cells=tuple(cells), file=file, source=original)


#: the deepest parse tree the front end takes (a cell, its block, a statement, then the expression's own
#: nesting: about 195 levels of operators or calls). Its walks (the transformer, checking, lowering)
#: recurse on expressions, a few Python frames a level: the limit keeps them far from Python's.
MAX_NESTING = 200


def _check_nesting(tree: lark.Tree, loc) -> None:
    """A `CellSyntaxError` at the first token too deep in `tree` (walked with a stack, not recursion)."""
    stack: list[tuple[lark.Tree | Token, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Token):
            continue
        if depth > MAX_NESTING:
            token = _first_token(node)
            where = loc(token.line, token.column) if token is not None else None
            raise CellSyntaxError(
                f"expression nested too deeply (over {MAX_NESTING} levels of operators and calls): "
                "split it into statements of their own",
                where,
            )
        stack.extend((child, depth + 1) for child in node.children if child is not None)


def _first_token(tree: lark.Tree) -> Token | None:
    stack: list[lark.Tree | Token | None] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Token):
            return node
        if node is not None:
            stack.extend(reversed(node.children))
    return None


def _end_loc(lines: list[str], file: str) -> SourceLoc:
    while len(lines) > 1 and not lines[-1].strip():
        lines = lines[:-1]  # the last line with text (the file may end in line feeds)
    if not lines:
        return SourceLoc(file, 1, 1, "")
    return SourceLoc(file, len(lines), len(lines[-1]) + 1, lines[-1])


def _describe_terminal(name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    try:
        pattern = _lark().get_terminal(name).pattern
    except KeyError:
        return name
    if isinstance(pattern, lark.lexer.PatternStr):
        return repr(pattern.value)
    return name.lower()


#: the terminals of the words Version 3 made keywords (a file that used one as a name must rename it)
_VERSION_3_KEYWORDS = frozenset({"EDGE", "DOWN", "PARENT", "GRAPH", "PREV"})


def _slip(source: str, token: Token) -> str:
    """The message for a slip users make often, saying what to write instead ("" for any other error)."""
    start = token.start_pos if token.start_pos is not None else 0
    before = source[:start].rstrip()
    if str(token) == "*" and before.endswith("*"):
        return "there is no power operator '**': write x * x for a square (exp(p * log(x)) for x > 0 otherwise)"
    if token.type in _VERSION_3_KEYWORDS:
        return (
            f"'{token}' is a keyword from Version 3 of the language on (edge.position, parent.h, prev.h, cell ... down,"
            " on graph(steps = T)):"
            " a name cannot be spelt so; rename it"
        )
    return ""


def _unexpected_message(token: Token | None, expected: Iterable[str]) -> str:
    if token is None or token.type == "$END":
        closing = "'}'" if any(_describe_terminal(n) == "'}'" for n in expected) else ""
        return "unexpected end of file" + (f", expected {closing}" if closing else "")
    found = repr(str(token))
    wanted = sorted({_describe_terminal(name) for name in expected})
    if not wanted:
        return f"unexpected {found}"
    if len(wanted) == 1:
        return f"unexpected {found}, expected {wanted[0]}"
    return f"unexpected {found}, expected one of {', '.join(wanted)}"


@v_args(inline=True)
class _ToAst(Transformer):
    """Builds `ast` nodes bottom-up; every node gets the location of its first token."""

    def __init__(self, loc):
        super().__init__(visit_tokens=False)
        self._loc = loc

    def _at(self, token: Token) -> SourceLoc:
        return self._loc(token.line, token.column)

    # --- module and cell -------------------------------------------------
    def module(self, *cells):
        return list(cells)

    def cell(self, name, structure, down, *items):
        kind, arity, steps = structure
        body: list = []
        for item in items:  # a declaration line gives a list of items
            if isinstance(item, list):
                body.extend(item)
            elif item is not None:
                body.append(item)
        return ast.CellDef(str(name), kind, arity, tuple(body), self._at(name), down is not None, steps)

    def tree(self, keyword, arity=None):
        return ("tree", arity, None)

    def dag(self, keyword, arity=None):
        return ("dag", arity, None)

    def graph(self, keyword, name, steps):
        if str(name) != "steps":
            raise CellSyntaxError(f"a graph cell is written 'on graph(steps = T)', not '{name} = ...'", self._at(name))
        return ("graph", None, steps)

    def arity(self, number):
        return self._number(number)

    def empty(self, *_):
        return None

    # --- declarations -----------------------------------------------------
    def dim_decl(self, keyword, *items):
        return list(items)

    def dim_item(self, name, number):
        return ast.DimDecl(str(name), self._number(number), self._at(name))

    def input_decl(self, keyword, *items):
        return list(items)

    def float_input(self, name, shape, on_edge=None):
        return ast.InputDecl(str(name), shape, None, self._at(name), on_edge is not None)

    def index_input(self, name, size, on_edge=None):
        return ast.InputDecl(str(name), (), size, self._at(name), on_edge is not None)

    def on_edge(self, edge):
        return True

    def param_decl(self, keyword, *items):
        return list(items)

    def param_item(self, name, shape, init=None):
        return ast.ParamDecl(str(name), shape, init, self._at(name))

    def init(self, name, args=None):
        return ast.InitSpec(str(name), tuple(args or ()), self._at(name))

    def init_args(self, *args):
        return [a for a in args if a is not None]

    def signed(self, *parts):
        *sign, number = parts
        value = self._number(number).value
        return -value if sign and sign[0] is not None and str(sign[0]) == "-" else value

    def state_decl(self, keyword, *items):
        return list(items)

    def state_item(self, name, shape):
        return ast.StateDecl(str(name), shape, self._at(name))

    def shape(self, *exprs):
        return tuple(exprs)

    # --- blocks -------------------------------------------------------------
    def leaf_block(self, keyword, *stmts):
        return ast.Block("leaf", tuple(s for s in stmts if s is not None), self._at(keyword))

    def node_block(self, keyword, *stmts):
        return ast.Block("node", tuple(s for s in stmts if s is not None), self._at(keyword))

    def root_block(self, keyword, *stmts):
        return ast.Block("root", tuple(s for s in stmts if s is not None), self._at(keyword))

    def init_block(self, keyword, *stmts):
        return ast.Block("init", tuple(s for s in stmts if s is not None), self._at(keyword))

    def assign(self, *parts):
        eq_index = next(i for i, p in enumerate(parts) if isinstance(p, Token) and p.type == "EQ")
        targets = tuple(parts[:eq_index])
        values = tuple(parts[eq_index + 1 :])
        return ast.Assign(targets, values, self._at(parts[eq_index]))

    def target(self, name):
        return ast.Target(str(name), self._at(name))

    def output_decl(self, keyword, name, shape, *rest):
        at_root = len(rest) == 3
        expr = rest[-1]
        return ast.OutputDecl(str(name), shape, at_root, expr, self._at(name))

    def at_root(self, *_):
        return True

    # --- expressions -------------------------------------------------------
    def _number(self, token):
        text = str(token)
        if len(text) > MAX_NUMBER_LENGTH:  # int() refuses over 4300 digits; nothing real is this long
            raise CellSyntaxError(
                f"number {text[:12]}...{text[-8:]} has {len(text)} characters, at most {MAX_NUMBER_LENGTH}",
                self._at(token),
            )
        return ast.Number(text, self._at(token))

    def number(self, token):
        return self._number(token)

    sint = number

    def name(self, token):
        return ast.Name(str(token), self._at(token))

    sname = name

    def binary(self, left, op, right):
        return ast.Binary(str(op), left, right, self._at(op))

    sbinary = binary

    def neg(self, minus, operand):
        return ast.Neg(operand, self._at(minus))

    def unary(self, plus, operand):  # `+x` (the only `unary` tree left by the grammar) is just x
        return operand

    def call(self, func, *args):
        return ast.Call(str(func), tuple(a for a in args if a is not None), self._at(func))

    def slice(self, base, *parts):
        colon_index = next(i for i, p in enumerate(parts) if isinstance(p, Token))
        lo = parts[colon_index - 1] if colon_index > 0 else None
        hi = parts[colon_index + 1] if colon_index + 1 < len(parts) else None
        return ast.Slice(base, lo, hi, _loc_of(base))

    def slice_bound(self, expr):
        return expr

    def index(self, base, bracket, expr):
        return ast.Index(base, expr, self._at(bracket))

    def child_all(self, keyword, state):
        return ast.ChildAll(str(state), self._at(keyword))

    def child_at(self, keyword, k, state):
        return ast.ChildAt(k, str(state), self._at(keyword))

    def edge_all(self, keyword, name):
        return ast.EdgeAll(str(name), self._at(keyword))

    def edge_at(self, keyword, k, name):
        return ast.EdgeAt(k, str(name), self._at(keyword))

    def parent_all(self, keyword, state):
        return ast.ParentAll(str(state), self._at(keyword))

    def prev_all(self, keyword, state):
        return ast.PrevAll(str(state), self._at(keyword))


def _loc_of(expr) -> SourceLoc:
    return expr.loc
