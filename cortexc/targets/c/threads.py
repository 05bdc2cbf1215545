"""How many threads a CPU call may use: the user's caps and the load of other processes.

The compiled CPU code chooses its threads per call (`cx_call_threads`), at most `OMP_NUM_THREADS`, at most
`CORTEXC_NUM_THREADS` (`thread_cap`) and at most the CPUs other runnable processes leave free (`MACHINE`,
read from /proc/loadavg; `CORTEXC_ADAPT_THREADS=0` turns that cap off). None of this changes a result:
the kernels give the same bits at any thread count.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

#: the cortexc setting that caps the threads of the compiled CPU code (below `OMP_NUM_THREADS`)
THREADS_VARIABLE = "CORTEXC_NUM_THREADS"
#: libgomp's spin count before a waiting thread sleeps, when the user sets no wait policy: its default
#: (300000 spins, ~1 ms) makes every barrier cost a time slice when another process takes a core
SPIN_COUNT = "10000"


def default_wait_policy() -> None:
    """Bounded spinning at OpenMP barriers unless the user chose a policy (read when libgomp loads)."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def thread_cap() -> int:
    """`CORTEXC_NUM_THREADS` as a positive int, or 0 (no cap of ours) when unset or not a positive int."""
    text = os.environ.get(THREADS_VARIABLE, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else 0


#: "0" turns off the cap by other processes' load below (for measurements and tests of exact thread counts)
ADAPT_VARIABLE = "CORTEXC_ADAPT_THREADS"
#: where Linux shows how many threads are runnable right now (the 4th field of /proc/loadavg: "runnable/total")
LOADAVG = "/proc/loadavg"
#: how long the OpenMP workers of a call may still spin after it (GOMP_SPINCOUNT spins), runnable but ours
#: (used only where this process's threads cannot be read, see `own_runnable`)
SPIN_WINDOW_S = 0.002
#: this process's threads: their states tell our own runnable threads (ours or torch's OpenMP workers still
#: spinning after a parallel region, other Python threads) from other processes' load
TASKS = "/proc/self/task"
#: more threads than this are not read one by one at each load reading (the spin window is used instead)
OWN_TASKS_MAX = 64
#: how long one reading of /proc/loadavg serves the calls that follow (a reading is an instant's sample anyway)
LOAD_REFRESH_S = 0.005
#: a CPU counts as free if any reading of the last this many seconds saw it free: a busy neighbour is
#: runnable at every reading, a kernel thread or a short-lived process at one (on 2 CPUs, one such sample
#: would otherwise put the calls of the next few ms on one thread)
LOAD_WINDOW_S = 0.02
#: the machine's CPUs (`os.cpu_count` reads sysfs each time: ~10 us, once here)
CPUS = os.cpu_count() or 1


def runnable_others(loadavg: bytes, own_spinning: int) -> int | None:
    """Threads runnable besides the caller and `own_spinning` workers of ours, from /proc/loadavg's text
    (None when it does not read as Linux writes it)."""
    fields = loadavg.split()
    if len(fields) < 4 or not fields[3].split(b"/")[0].isdigit():
        return None
    return max(0, int(fields[3].split(b"/")[0]) - 1 - own_spinning)


def own_runnable(task_dir: str | None = None) -> int | None:
    """Threads of this process that are runnable now besides the caller (state R in their stat), or None
    when they cannot be read (not Linux) or are too many to read at every load reading. Why: the runnable
    count of /proc/loadavg includes our own threads, e.g. the OpenMP workers of a torch op that ran just
    before (the same libgomp pool as ours when torch is loaded), spinning for a while after it; counted as
    other processes' load they would turn every call that follows a torch op to one thread."""
    task_dir = TASKS if task_dir is None else task_dir
    try:
        names = os.listdir(task_dir)
    except OSError:
        return None
    if len(names) > OWN_TASKS_MAX:
        return None
    caller = str(threading.get_native_id())
    count = 0
    for name in names:
        if name == caller:
            continue
        try:
            fd = os.open(f"{task_dir}/{name}/stat", os.O_RDONLY)
        except OSError:  # the thread has ended since the listing
            continue
        try:
            text = os.read(fd, 512)
        except OSError:
            continue
        finally:
            os.close(fd)
        end = text.rfind(b")")  # the state follows the command name, which may hold spaces and parentheses
        if end >= 0 and text[end + 2 : end + 3] == b"R":
            count += 1
    return count


class _Machine:
    """Whether other processes take cores now: a call runs on at most the CPUs the others leave free, so a
    busy neighbour turns a call to one thread instead of making every level barrier wait a time slice for
    a thread that has no core. Read from /proc/loadavg (one pread, ~1 us) at most every `LOAD_REFRESH_S`:
    calls that follow each other closely share a reading; where that file does not exist nothing is
    capped. This process's own runnable threads (`own_runnable`: our or torch's OpenMP workers still
    spinning, other threads of the caller) are not load."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.opened = False
        self.last_end = 0.0
        self.last_threads = 1
        self.reading = (-1.0, 0)  # (when, free CPUs): one value, replaced whole (calls from several threads)
        self.recent: deque[tuple[float, int]] = deque(maxlen=8)  # the readings of the last `LOAD_WINDOW_S`

    def free_cpus(self) -> int:
        """CPUs not taken by other runnable threads (at least 1), or 0 when unknown: the most that a reading
        of the last `LOAD_WINDOW_S` saw free."""
        now = time.monotonic()
        when, free = self.reading
        if not 0.0 <= now - when < LOAD_REFRESH_S:
            free = self._read(now)
            self.reading = (now, free)
            self.recent.append((now, free))
        if free == 0:
            return 0
        return max([free] + [seen for at, seen in list(self.recent) if 0.0 <= now - at < LOAD_WINDOW_S and seen])

    def _read(self, now: float) -> int:
        if not self.opened:
            self.opened = True
            try:
                self.fd = os.open(LOADAVG, os.O_RDONLY)
            except OSError:
                self.fd = None
        if self.fd is None:
            return 0
        try:
            text = os.pread(self.fd, 128, 0)
        except OSError:
            return 0
        own = own_runnable()
        if own is None:
            own = self.last_threads - 1 if now - self.last_end < SPIN_WINDOW_S else 0
        others = runnable_others(text, own)
        return 0 if others is None else max(1, CPUS - others)

    def ended(self, threads: int) -> None:
        self.last_end, self.last_threads = time.monotonic(), max(threads, 1)


MACHINE = _Machine()
