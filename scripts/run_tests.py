"""Run the test suite as one pytest process per test file, as many at once as the machine has cores.

Why: most of the suite's time is single-threaded (gcc builds of packages, the reference interpreter), so
one pytest process leaves all cores but one idle. Files are handed out from one queue, the slowest
(`SLOWEST_FIRST`, measured with `--durations`) first, so the processes end at about the same time. All
of them share one build cache (`CORTEXC_TEST_CACHE`, a fresh directory per run; builds are renamed into
place, so concurrent builders are safe), so a package several files load is built about once.

Arguments are pytest's. With a path among them (a file or a test id) it runs one pytest on exactly that;
otherwise every `tests/**/test_*.py` (in folders by layer and target), each with the arguments. `--jobs N`
sets the number of processes (default: the CPUs this process may run on). A file's output is printed when it
ends: in full when it failed, else its summary line and its skip reasons. The exit status is non-zero when
any file failed (a file whose tests were all deselected is not a failure).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

#: the files that take longest (minutes on 2 cores), started first; the rest follow in name order
SLOWEST_FIRST = (
    "test_invented_cells.py",
    "test_export.py",
    "test_compiled.py",
    "test_determinism.py",
    "test_cuda_target.py",
    "test_dropout.py",
    "test_attention.py",
    "test_export_fold.py",
    "test_compiled_backward.py",
    "test_train.py",
)

#: pytest's exit status when every test of a file was deselected (by -m or -k): not a failure
NO_TESTS_COLLECTED = 5


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _files() -> list[Path]:
    rank = {name: number for number, name in enumerate(SLOWEST_FIRST)}
    return sorted(TESTS.rglob("test_*.py"), key=lambda path: (rank.get(path.name, len(rank)), path.name))


def _takes_a_path(args: list[str]) -> bool:
    """Whether pytest's arguments name what to run (then they are run as given, in one process)."""
    return any(not arg.startswith("-") and (REPO / arg.split("::")[0]).exists() for arg in args)


def _report(path: Path, status: int, log: Path, seconds: float, tally: Counter[str]) -> bool:
    """Print how one file's pytest ended (its whole output when it failed), add its counts to `tally`;
    whether it passed."""
    text = log.read_text(errors="replace")
    summary = next((line for line in reversed(text.splitlines()) if line.strip()), "(no output)")
    for count, outcome in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)\b", summary):
        tally[outcome] += int(count)
    passed = status in (0, NO_TESTS_COLLECTED)
    print(f"{'ok  ' if passed else 'FAIL'} {path.name} ({seconds:.0f} s): {summary}")
    if not passed:
        print(text)
    else:  # what `-ra` lists of a passing file: why a test was skipped (the suite's skips must have reasons)
        for line in text.splitlines():
            if line.startswith(("SKIPPED", "XFAIL", "XPASS")):
                print(f"     {line}")
    sys.stdout.flush()
    return passed


def main(argv: list[str]) -> int:
    jobs = _cpus()
    if "--jobs" in argv:
        at = argv.index("--jobs")
        jobs = max(1, int(argv[at + 1]))
        argv = argv[:at] + argv[at + 2 :]
    pytest = [sys.executable, "-m", "pytest"]
    if jobs == 1 or _takes_a_path(argv):
        return subprocess.call([*pytest, *argv], cwd=REPO)
    work = Path(tempfile.mkdtemp(prefix="cortexc-tests-"))
    env = dict(os.environ, CORTEXC_TEST_CACHE=str(work / "cache"))
    queue = _files()
    running: dict[Path, tuple[subprocess.Popen, float]] = {}
    failed: list[str] = []
    tally: Counter[str] = Counter()
    start = time.monotonic()
    try:
        while queue or running:
            while queue and len(running) < jobs:
                path = queue.pop(0)
                with open(work / f"{path.stem}.log", "w") as log:  # the child keeps its own descriptor
                    command = [*pytest, *argv, str(path.relative_to(REPO))]
                    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
                running[path] = (process, time.monotonic())
            time.sleep(0.2)
            for path, (process, began) in list(running.items()):
                status = process.poll()
                if status is not None:
                    del running[path]
                    if not _report(path, status, work / f"{path.stem}.log", time.monotonic() - began, tally):
                        failed.append(path.name)
    finally:
        for process, _ in running.values():
            process.kill()
            process.wait()
        shutil.rmtree(work, ignore_errors=True)
    verdict = f"{len(failed)} file(s) failed: {', '.join(failed)}" if failed else "every file passed"
    counts = ", ".join(f"{number} {outcome}" for outcome, number in sorted(tally.items()))
    print(f"{verdict}: {counts} ({time.monotonic() - start:.0f} s, {jobs} processes at once)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
