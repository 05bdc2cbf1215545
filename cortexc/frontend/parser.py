"""Text -> AST: the Lark LALR parser and a transformer to frozen dataclasses.

Syntax errors become `CellSyntaxError` at the offending token, with the set of
tokens the grammar would have accepted written as the user would type them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from importlib import resources

import lark
from lark import Token, Transformer, v_args

from cortexc.errors import CellSyntaxError, SourceLoc
from cortexc.frontend import ast

#: how a terminal that is not a fixed string is described in messages
_TERMINAL_WORDS = {"NAME": "a name", "NUMBER": "a number", "$END": "end of file"}


@functools.cache
def _lark() -> lark.Lark:
    grammar = resources.files("cortexc.grammars").joinpath("cell.lark").read_text(encoding="utf-8")
    return lark.Lark(grammar, start="module", parser="lalr", lexer="basic", maybe_placeholders=True)


def parse(source: str, file: str = "<string>") -> ast.Module:
    """Parse a whole `.cell` file into an `ast.Module` (raises `CellSyntaxError`)."""
    lines = source.splitlines()

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
        raise CellSyntaxError(_unexpected_message(err.token, err.expected), where) from None
    except lark.exceptions.UnexpectedEOF as err:
        raise CellSyntaxError(_unexpected_message(None, err.expected), _end_loc(lines, file)) from None
    _check_nesting(tree, loc)
    cells = _ToAst(loc).transform(tree)
    return ast.Module(cells=tuple(cells), file=file, source=source)


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

    def cell(self, name, structure, *items):
        kind, arity = structure
        body: list = []
        for item in items:  # a declaration line gives a list of items
            if isinstance(item, list):
                body.extend(item)
            elif item is not None:
                body.append(item)
        return ast.CellDef(str(name), kind, arity, tuple(body), self._at(name))

    def tree(self, keyword, arity=None):
        return ("tree", arity)

    def dag(self, keyword, arity=None):
        return ("dag", arity)

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

    def float_input(self, name, shape):
        return ast.InputDecl(str(name), shape, None, self._at(name))

    def index_input(self, name, size):
        return ast.InputDecl(str(name), (), size, self._at(name))

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
        value = float(number)
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
        return ast.Number(str(token), self._at(token))

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


def _loc_of(expr) -> SourceLoc:
    return expr.loc
