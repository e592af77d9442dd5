"""A proxy speaking plaintext to the TLS ext_proc port, recognised and logged as such.

With --secure-serving (the default) and a gateway that dials the picker in plaintext
(`prefix-epp envoy-config --epp-tls=false`, the chart's tls.enabled=false), every TLS handshake
fails and the client gets a 500 with an empty body. gRPC gives the application no hook for a
failed handshake (no interceptor or callback runs before one succeeds); the only trace is the
line gRPC's core writes to the process's stderr:
`ssl_transport_security.cc:...] Handshake failed with error SSL_ERROR_SSL: ...:WRONG_VERSION_NUMBER`
(or `HTTP_REQUEST`: an HTTP/1 request on the TLS port).

`start(log_level)` puts a relay between the process's stderr (file descriptor 2, which gRPC's core
writes to) and the real one: a child process (`python -m extproc.transport.tls_mismatch LEVEL`)
that copies every byte through unchanged and, on such a line, logs a structured warning naming
the flags that fix it: the first at once, then at most one a minute with the count since the
last (`Reporter`). A child rather than a thread: a relay must outlive the process it serves to
pass on the last lines of a crash. It ignores the terminal's signals and ends when every writer
has closed its end (this process and the workers it starts); at exit this process hands its
stderr back and waits for the relay to pass on what is left, so the log is complete when it ends.

What is and is not recognised:
- recognised: a plaintext (or HTTP/1) client on the TLS ext_proc port, as gRPC logs it (not with
  GRPC_VERBOSITY=NONE, which silences that line); gRPC's line does not name the client, so the
  warning cannot name it either. The same line comes from a TLS dial of a plaintext peer by peer
  sync (--sync-tls on some replicas only); the warning names that fix too.
- not recognised: a TLS client on a plaintext picker (--secure-serving=false with
  `envoy-config --epp-tls`): gRPC's plaintext server drops the connection without logging
  anything; only the proxy's log shows it (docs/configuration.md, "TLS between the gateway and
  the picker").
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

MARKERS = (b"WRONG_VERSION_NUMBER", b"HTTP_REQUEST")
EVERY_S = 60.0  # after the first warning, at most one a minute
FIX = ("the gateway dials this TLS port in plaintext: match the two sides, either TLS on the gateway "
       "(prefix-epp envoy-config --epp-tls, the chart's tls.enabled=true) or plaintext on the picker "
       "(--secure-serving=false); for peer sync, --sync-tls on every replica or on none")
_CHUNK = 65536
_LINE_LIMIT = 8192  # an unterminated line is scanned by its last bytes only

log = logging.getLogger("prefix_epp.tls")


class Reporter:
    """Counts handshake failures on each stderr line and logs the first, then one a minute."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: float | None = None
        self._unreported = 0
        self._partial = b""

    def feed(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()[-_LINE_LIMIT:]
        for line in lines:
            if b"Handshake failed" in line and any(m in line for m in MARKERS):
                self._failed()

    def _failed(self) -> None:
        self._unreported += 1
        now = self._clock()
        if self._last is not None and now - self._last < EVERY_S:
            return
        log.warning("TLS handshake failed: a plaintext client on the TLS ext_proc port", extra={
            "kind": "plaintext-to-tls", "handshakes_failed": self._unreported, "fix": FIX})
        self._last, self._unreported = now, 0


def relay(source: int, sink: int, reporter: Reporter) -> None:
    """Copy `source` to `sink` until end of file, every byte unchanged, feeding `reporter`."""
    while data := os.read(source, _CHUNK):
        view = memoryview(data)
        while view:
            view = view[os.write(sink, view):]
        reporter.feed(data)


def start(log_level: str) -> None:
    """Route this process's stderr through the relay (see the module docstring)."""
    read_end, write_end = os.pipe()
    child = subprocess.Popen([sys.executable, "-m", "extproc.transport.tls_mismatch", log_level],
                             stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True)
    os.close(read_end)
    sys.stderr.flush()
    real = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)

    def finish() -> None:
        sys.stderr.flush()
        os.dup2(real, 2)  # closes this process's end of the pipe: the relay sees the end once workers exit
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()

    atexit.register(finish)


def main() -> None:
    from extproc.core import logs

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # it ends when its writers do, never before them
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logs.setup(sys.argv[1] if len(sys.argv) > 1 else "info")
    relay(sys.stdin.fileno(), sys.stderr.fileno(), Reporter())


if __name__ == "__main__":
    main()
