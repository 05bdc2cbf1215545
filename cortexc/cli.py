"""The `cortexc` command line: check, compile, export and run `.cell` files.

Every user error (a bad `.cell` file, a bad forest, bad `-D`) is printed as a
located message on stderr with exit status 1 and no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cortexc.errors import CellError, CortexcError, DimError
from cortexc.ir.cell import Cell
from cortexc.ir.ops import fmt_shape
from cortexc.options import KNOWN_TARGETS, MAX_DIM, CompileOptions
from cortexc.runtime.abi import LaunchMode, LaunchOptions
from cortexc.runtime.backends import BACKENDS, DEFAULT_DEVICE, targets_of
from cortexc.runtime.signature import CellSignature

#: `cortexc compile --target`: a device's kernels, or every target's
TARGET_CHOICES = {**{d: targets_of((d,)) for d in BACKENDS if BACKENDS[d].target is not None}, "all": KNOWN_TARGETS}


def parse_defines(items: list[str]) -> dict[str, int]:
    """`-D NAME=VALUE` pairs as a dict (values must be positive integers)."""
    defines: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        digits = value.strip()
        shown = item if len(item) <= 60 else f"{item[:40]}... ({len(item)} characters)"
        if not sep or not name.isidentifier() or not (digits.isascii() and digits.isdigit()) or not digits.strip("0"):
            raise DimError(f"-D {shown}: expected NAME=VALUE with a positive integer VALUE")
        if len(digits.lstrip("0")) > len(str(MAX_DIM)):  # Python refuses to read ints of over 4300 digits
            raise DimError(f"-D {shown}: a dim must be at most {MAX_DIM}")
        defines[name] = int(digits)
    return defines


def summarize(cell: Cell) -> str:
    """A human summary of a checked cell: structure, dims, params with counts, inputs, states, outputs."""
    arity = f"(arity = {cell.arity})" if cell.arity is not None else ""
    arity += f"(steps = {cell.steps})" if cell.steps is not None else ""
    arity += " down" if cell.down else ""
    lines = [f"cell {cell.name} on {cell.structure.value}{arity}"]
    lines.append("  dims     " + ", ".join(f"{n} = {v}" for n, v in cell.dims) if cell.dims else "  dims     -")
    inputs = [
        (f"{i.name} : index[{i.index_range}]" if i.is_index else f"{i.name}{fmt_shape(i.shape)} float32")
        + (" on edge" if i.on_edge else "")
        for i in cell.inputs
    ]
    lines.append("  inputs   " + (", ".join(inputs) or "-"))
    total = 0
    width = max((len(p.name) + len(fmt_shape(p.shape)) for p in cell.params), default=0)
    for number, param in enumerate(cell.params):
        count = int(np.prod(param.shape))
        total += count
        head = "  params   " if number == 0 else "           "
        label = f"{param.name}{fmt_shape(param.shape)}"
        lines.append(f"{head}{label:<{width}}  {count:>12,}  init {param.init}")
    if cell.params:
        lines.append(f"           {'total':<{width}}  {total:>12,}")
    lines.append("  states   " + ", ".join(f"{s.name}{fmt_shape(s.shape)}" for s in cell.states))
    blocks = "leaf, node" if cell.leaf is not None else "node (leaves run it with no children)"
    if cell.steps is not None:
        blocks = f"init (step 0), node (steps 1..{cell.steps})"
    lines.append(f"  blocks   {blocks}")
    where = " after the last step" if cell.steps is not None else " at root"
    outputs = [f"{o.name}{fmt_shape(o.shape)}{where if o.at_root else ''}" for o in cell.outputs]
    lines.append("  outputs  " + (", ".join(outputs) or "-"))
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    from cortexc.frontend.parser import read_source
    from cortexc.pipeline import Source, compile_package, run_stages

    source = read_source(args.file)
    options = CompileOptions.make(parse_defines(args.define), KNOWN_TARGETS, args.dump_ir)
    compile_package(source, args.file, options)  # every stage, so that check fails where compile would
    cells = run_stages(Source(source, args.file), CompileOptions.make(options.define_map), until="lower")
    print(f"{args.file}: {len(cells)} cell{'s' if len(cells) != 1 else ''}, ok")
    for cell in cells:
        print(summarize(cell))
    _say_dumped(args.dump_ir)
    return 0


def _say_dumped(directory: str | None) -> None:
    if directory:
        count = sum(1 for p in Path(directory).iterdir() if p.suffix in (".ir", ".prog"))
        print(f"wrote {count} IR and program dumps to {directory}/")


def cmd_compile(args: argparse.Namespace) -> int:
    from cortexc.frontend.parser import read_source
    from cortexc.pipeline import write_package

    source = read_source(args.file)
    if os.path.lexists(args.out) and not os.path.isdir(args.out):
        raise CortexcError(f"-o {args.out}: that is a file; the package goes into a directory")
    launch = LaunchOptions(LaunchMode(args.cuda_mode), args.cuda_blocks, args.cuda_weights == "global")
    options = CompileOptions.make(parse_defines(args.define), TARGET_CHOICES[args.target], args.dump_ir, launch)
    package = write_package(source, args.file, args.out, options)
    files = ", ".join(sorted(p.name for p in package.iterdir()))
    print(f"wrote {package}/ ({files})")
    _say_dumped(args.dump_ir)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from cortexc.export import export

    directory = export(args.file, args.out, parse_defines(args.define), args.params, fold=not args.no_fold)
    files = ", ".join(sorted(p.name for p in directory.iterdir() if p.is_file()))
    print(f"wrote {directory}/ ({files}); build with: make -C {directory}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Compile a cell, run it compiled and (once, with a progress bar) with the reference interpreter on the
    same forest, compare."""
    from cortexc.pipeline import load_file
    from cortexc.runtime.forest import Forest

    defines = parse_defines(args.define)
    module = load_file(args.file, None, defines)
    cells = [getattr(module, name).signature for name in module.__all__]
    cell = _pick_cell(cells, args.cell)
    started = time.perf_counter()
    if args.trees:
        forest = _read_trees(args.trees, args.limit)
        where = args.trees
    else:
        forest = Forest.random(args.limit or 100, rng=0, binary=cell.arity == 2, max_children=cell.arity or 3)
        where = "built-in random forest"
    forest_s = time.perf_counter() - started
    inputs = _demo_inputs(cell, forest, np.random.default_rng(args.seed))
    compiled = getattr(module, cell.name)(device=DEFAULT_DEVICE, seed=args.seed)
    out = compiled(forest, **inputs)  # builds (or loads from the cache) the kernels
    compiled_s = min(_timed(compiled, forest, inputs) for _ in range(args.repeats))
    steps = cell.structure.steps
    levels = f"{steps} steps of every node" if steps else f"{forest.num_levels} levels"
    print(
        f"{cell.name} on {where}: {forest.num_trees} trees, {forest.num_nodes} nodes, "
        f"{levels} (forest built in {forest_s * 1e3:.1f} ms)"
    )
    print(f"  compiled (cpu): {compiled_s * 1e3:9.2f} ms  {forest.num_trees / compiled_s:12,.0f} trees/s")
    if not args.eager:
        return 0
    from cortexc import reference

    ir = getattr(module, cell.name).cell  # what device="interp" runs, compiled from the package's source
    started = time.perf_counter()
    visits = forest.num_nodes * (1 + steps)  # a graph cell visits every node at every step
    with progress_bar(visits, "interpreter", "nodes") as bar:  # once: timed and compared (it is slow)
        ref = reference.run(ir, forest, compiled.params, inputs, progress=bar.update)
    eager_s = time.perf_counter() - started
    print(f"  eager (interp): {eager_s * 1e3:9.2f} ms  {forest.num_trees / eager_s:12,.0f} trees/s")
    print(f"  compiled / eager speed-up: {eager_s / compiled_s:.1f}x")
    for name, value in ref.items():
        scale = float(np.abs(value).max()) or 1.0
        error = float(np.abs(out[name] - value).max()) / scale
        print(f"  {name}{list(value.shape)}: max |compiled - eager| / max |eager| = {error:.2e}")
    return 0


class _LineProgress:
    """A one-line progress report on stderr where tqdm is not installed (it is not a dependency):
    rewritten in place at most every half second on a terminal, else printed once at the end."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit = total, desc, unit
        self.done = 0
        self.started = self.shown = time.perf_counter()
        self.live = sys.stderr.isatty()

    def update(self, count: int) -> None:
        self.done += count
        now = time.perf_counter()
        if self.live and now - self.shown >= 0.5:
            self.shown = now
            print(f"\r{self._line(now)}", end="", file=sys.stderr, flush=True)

    def _line(self, now: float) -> str:
        percent = 100 * self.done // max(self.total, 1)
        return f"{self.desc}: {percent:3d}% {self.done:,}/{self.total:,} {self.unit} [{now - self.started:.1f} s]"

    def close(self) -> None:
        print(("\r" if self.live else "") + self._line(time.perf_counter()), file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress_bar(total: int, desc: str, unit: str) -> Iterator[Any]:
    """A progress bar with `update(k)`: tqdm's when it is importable, else `_LineProgress`; on stderr."""
    try:
        from tqdm import tqdm
    except ImportError:
        bar: Any = _LineProgress(total, desc, unit)
    else:
        bar = tqdm(total=total, desc=desc, unit=f" {unit}", unit_scale=True, file=sys.stderr, leave=True)
    try:
        yield bar
    finally:
        bar.close()


def _read_trees(path: str, limit: int | None):
    """The forest of a PTB file's first `limit` lines; every error in it names the file."""
    from cortexc.runtime.forest import Forest

    return Forest.from_ptb_file(path, limit)


def _timed(model, forest, inputs) -> float:
    started = time.perf_counter()
    model(forest, **inputs)
    return time.perf_counter() - started


def _demo_inputs(cell: CellSignature, forest, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs for a demo run: random features, and word ids from the trees' words when there are any."""
    from cortexc.runtime.vocab import Vocab

    inputs = {}
    for decl in cell.inputs:
        rows = forest.num_edges if decl.on_edge else forest.num_nodes
        if decl.is_index:
            if forest.words is not None and not decl.on_edge:
                ids = Vocab.build([forest]).encode(forest)
                ids = np.where(ids < decl.index_range, ids, 1)
            else:
                ids = rng.integers(0, decl.index_range, rows)
            inputs[decl.name] = ids.astype(np.int32)
        else:
            inputs[decl.name] = rng.standard_normal((rows, *decl.shape)).astype(np.float32)
    return inputs


def _pick_cell(cells: list[CellSignature], name: str | None) -> CellSignature:
    if name is None:
        return cells[0]
    for cell in cells:
        if cell.name == name:
            return cell
    raise CortexcError(f"no cell named {name!r} (the file has {', '.join(c.name for c in cells)})")


def _positive(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _non_negative(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def _blocks(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of blocks (0: no cap), got {text!r}")
    return int(text)


class _DefaultsShown(argparse.HelpFormatter):
    """Help that shows an option's default where it says something: not for flags, options without a
    default, or help that already states it (argparse's own formatter adds "(default: None)" to those)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or action.option_strings == [] or isinstance(default, bool) or default in (None, []):
            return text
        if default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    from cortexc.version import __version__

    parser = argparse.ArgumentParser(prog="cortexc", description="Compiler for recursive neural networks.")
    parser.add_argument("--version", action="version", version=f"cortexc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("file", help="a .cell file")
        p.add_argument(
            "-D",
            dest="define",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="override a dim in every cell that declares it",
        )

    check = sub.add_parser(
        "check",
        formatter_class=_DefaultsShown,
        help="parse and check a .cell file, print a summary of its cells",
    )
    common(check)
    check.add_argument("--dump-ir", metavar="DIR", help="write the IR of every stage to DIR")
    check.set_defaults(func=cmd_check)

    comp = sub.add_parser(
        "compile",
        formatter_class=_DefaultsShown,
        help="compile a .cell file into a Python package of kernels",
    )
    common(comp)
    comp.add_argument("-o", "--out", default="build", metavar="DIR", help="where the package goes (default build/)")
    comp.add_argument(
        "--target",
        choices=list(TARGET_CHOICES),
        default="all",
        help="which kernels to generate: those a device runs, or every target's (default)",
    )
    comp.add_argument("--dump-ir", metavar="DIR", help="write the IR of every stage to DIR")
    comp.add_argument(
        "--cuda-mode",
        choices=[m.value for m in LaunchMode],
        default=LaunchMode.SPLIT.value,
        help="the package's default CUDA launch (CORTEXC_CUDA_MODE overrides it at run time)",
    )
    comp.add_argument(
        "--cuda-blocks", type=_blocks, default=0, metavar="N", help="cap the CUDA grid at N blocks (default: no cap)"
    )
    comp.add_argument(
        "--cuda-weights",
        choices=["shared", "global"],
        default="shared",
        help="where split mode keeps its weight slices (default: shared memory when they fit)",
    )
    comp.set_defaults(func=cmd_compile)

    exp = sub.add_parser(
        "export",
        formatter_class=_DefaultsShown,
        help="write a C library, a _run program per cell and a Makefile (no Python to run)",
    )
    common(exp)
    exp.add_argument("-o", "--out", default="dist", metavar="DIR", help="where <stem>/ goes (default dist/)")
    exp.add_argument(
        "--params",
        metavar="FILE",
        help="trained params (.npz or .safetensors; <Cell>.<name> in a file of several cells); default Cell(seed=0)'s",
    )
    exp.add_argument(
        "--no-fold",
        action="store_true",
        help="never fold look-up projections into tables at load (by default a load builds them: see <Cell>.h)",
    )
    exp.set_defaults(func=cmd_export)

    run = sub.add_parser(
        "run",
        formatter_class=_DefaultsShown,
        help="run a cell compiled and eager over PTB trees (or a built-in forest)",
    )
    common(run)
    run.add_argument(
        "--trees", metavar="PATH", help="PTB bracketed trees, one per line (default: a built-in random forest)"
    )
    run.add_argument("--cell", help="which cell of the file (default: the first)")
    run.add_argument("--limit", type=_positive, default=None, metavar="N", help="use only the first N trees")
    run.add_argument(
        "--seed",
        type=_non_negative,
        default=0,
        help="seeds the params and the inputs (the built-in forest is always the same)",
    )
    run.add_argument(
        "--repeats", type=_positive, default=5, metavar="N", help="compiled runs to time (the best is shown)"
    )
    run.add_argument(
        "--no-eager",
        dest="eager",
        action="store_false",
        help="run the compiled cell only (default: compiled and the interpreter, compared)",
    )
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        status = args.func(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at exit
        return status
    except BrokenPipeError:  # `cortexc ... | head -1`: the reader is gone; end quietly as standard tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing left to flush into the closed pipe at exit
        return 141  # 128 + SIGPIPE: what a shell reports for a tool the closed pipe ended
    except CellError as err:  # file:line:col: error: ... (or error: ... without a place)
        print(err.format(), file=sys.stderr)
        return 1
    except CortexcError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {where}{err.strerror or err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
