"""bench.run bookkeeping: per-process CPU from /proc, and the note when a router could not run."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.run import process_cpu_s, write_results


def test_process_cpu_counts_this_process_and_ignores_gone_pids() -> None:
    before = process_cpu_s([os.getpid()])
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:
        pass
    after = process_cpu_s([os.getpid(), 2**22 + 12345])  # a pid that does not exist adds nothing
    assert after - before >= 0.1


def test_results_say_which_router_did_not_run_and_why(tmp_path: Path) -> None:
    config = {"replicas": 4, "time_scale": 1.0, "not_run": {"go-epp": "no Go toolchain"}}
    write_results(tmp_path, "t", config, {}, [], {}, [])
    assert "Not run: go-epp: no Go toolchain." in (tmp_path / "t.md").read_text()
