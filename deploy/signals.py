"""How ``inferq up`` stops: SIGTERM, SIGINT and SIGHUP all end it the same way, by stopping every child.

Without handlers, SIGTERM and SIGHUP killed the launcher on the spot and left the API, the worker and the
embedded redis-server running. Here a stop signal becomes an exception in the main thread, so the
launcher's ``finally`` runs: each child gets SIGTERM (the worker finishes its in-flight jobs, see
docs/SERVICE.md), then the embedded Redis stops. A second stop signal while waiting kills the children at
once, for a user who does not want to wait for the drain.
"""

from __future__ import annotations

import signal
import subprocess
import time
from typing import Any

from inferq.log import get_logger

log = get_logger("deploy.launcher")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopRequested(KeyboardInterrupt):
    """A stop signal arrived. A ``KeyboardInterrupt`` so that no ``except Exception`` on the way swallows
    it, and the CLI's Ctrl-C exit applies wherever the launcher does not catch it itself."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.signame = signal.Signals(signum).name


def _raise_stop(signum: int, _frame: Any) -> None:
    raise StopRequested(signum)


def on_stop_signals() -> None:
    """From now on, SIGTERM, SIGINT and SIGHUP raise ``StopRequested`` in the main thread."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_stop)


def stop_children(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM every child still running, wait up to ``grace`` seconds for all of them, SIGKILL the rest."""

    def _kill_now(signum: int, _frame: Any) -> None:
        log.warning("second stop signal: killing the children now", signal=signal.Signals(signum).name)
        for p in procs:
            if p.poll() is None:
                p.kill()

    for sig in STOP_SIGNALS:
        signal.signal(sig, _kill_now)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("child did not stop in time: killing it", pid=p.pid, grace_seconds=grace)
            p.kill()
            p.wait()
