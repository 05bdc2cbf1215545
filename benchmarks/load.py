"""A competing load for the benchmarks' loaded runs: users share machines (a DataLoader worker, a second job,
DDP ranks), so a benchmark reports how each library slows down next to one busy process, side by side."""

from __future__ import annotations

import os
import subprocess
import sys
import time


class Busy:
    """One competing busy process (a Python spin loop) for the duration of a `with` block, stopped by its pid."""

    def __enter__(self) -> Busy:
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.3)  # running, and seen by the load readings, before anything is timed
        return self

    def __exit__(self, *_: object) -> None:
        os.kill(self.process.pid, 9)
        self.process.wait()
