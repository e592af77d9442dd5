"""`freeze_startup_heap` (what `prefix-epp serve` calls once the App is built): after it, a full
collection walks nothing start-up made, so it no longer holds the event loop for the whole heap.
Run in a fresh interpreter, as the picker's process is: freezing the test process's heap would
keep its later cyclic garbage."""

from __future__ import annotations

import json
import subprocess
import sys

from testkit.procs import REPO_ROOT

PROBE = """
import gc, json
import extproc.commands.serve, extproc.runtime.app, extproc.transport.grpc_server
from extproc.runtime.app import freeze_startup_heap
before = len(gc.get_objects())
frozen = freeze_startup_heap()
print(json.dumps({"before": before, "frozen": frozen, "after": len(gc.get_objects())}))
"""


def test_the_startup_heap_is_frozen_out_of_full_collections() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    figures = json.loads(out.stdout)
    assert figures["before"] > 10_000  # the modules a picker imports
    assert figures["frozen"] >= figures["before"] * 0.9
    assert figures["after"] < 100  # what a gen-2 pass still walks
