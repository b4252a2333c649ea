"""What ``inferq generate`` shows and writes while it runs: results on disk as each line finishes, and
progress (a bar on a terminal, a periodic log line otherwise).

Results are written the moment a line finishes, so an interrupted or killed run keeps every finished line
(a run of hours must never end with nothing on disk). Every row carries ``line``, its 1-based line number
in the input file: the one key that identifies a row when ids are missing or repeated.

* default: rows are appended in completion order while the run goes on; when every line has finished,
  the file is rewritten in input order (atomically). An interrupted run leaves its finished lines in
  completion order.
* ``ordered``: the file is in input order at every moment: a finished line waits until every line before
  it is written. On an interrupt, the finished lines still waiting are written too, in input order, so
  the file then has gaps where the unfinished lines were.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from inferq.log import get_logger

log = get_logger("worker.generate")


class ResultWriter:
    def __init__(self, path: Path, *, ordered: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.ordered = ordered
        self.rows: dict[int, dict[str, Any]] = {}  # input position -> row
        self._written: set[int] = set()
        self._next = 0  # ordered: the first position not written yet
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (open for the whole run)

    def add(self, position: int, row: dict[str, Any]) -> None:
        """The result of the input line at ``position`` (0-based among the non-blank lines)."""
        self.rows[position] = row
        if not self.ordered:
            self._write(position)
            return
        while self._next in self.rows:
            self._write(self._next)
            self._next += 1

    def finish(self, *, complete: bool) -> None:
        """``complete``: every line finished, so rewrite the file in input order. Otherwise (interrupted)
        keep what is there, adding in order the finished lines that ``ordered`` still held back."""
        if not complete:
            for position in sorted(self.rows):
                if position not in self._written:
                    self._write(position)
            self._file.close()
            return
        self._file.close()
        if self.ordered:
            return  # already in input order
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for position in sorted(self.rows):
                f.write(json.dumps(self.rows[position], ensure_ascii=False) + "\n")
        os.replace(tmp, self.path)

    def _write(self, position: int) -> None:
        self._file.write(json.dumps(self.rows[position], ensure_ascii=False) + "\n")
        self._file.flush()
        self._written.add(position)


class BatchProgress:
    """Lines done of the total, completion tokens per second and the time left: a rich bar when stderr
    is a terminal, else one structlog line every ``interval`` seconds (logs of a batch job stay useful)."""

    def __init__(self, total: int, interval: float) -> None:
        self.total, self.interval = total, interval
        self.done = self.failed = self.tokens = 0
        self.started = time.monotonic()
        self._next_log = self.started + interval
        self._bar: Any = None
        if sys.stderr.isatty():
            self._start_bar()

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("lines"),
                             TextColumn("{task.fields[tok_s]:.0f} tok/s"), TextColumn("ETA"),
                             TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self._bar.start()
        self._task = self._bar.add_task("generate", total=self.total, tok_s=0.0)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def tok_s(self) -> float:
        return self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    def eta_seconds(self) -> float | None:
        """Time left at the rate lines have finished so far (None before the first one)."""
        if not self.done:
            return None
        return (self.total - self.done) * self.elapsed / self.done

    def line_done(self, failed: bool) -> None:
        self.done += 1
        self.failed += int(failed)
        self._update()

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self._update()

    def _update(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, tok_s=self.tok_s)
            return
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + self.interval
            eta = self.eta_seconds()
            log.info("generate progress", done=self.done, total=self.total, failed=self.failed, tokens=self.tokens,
                     tok_s=round(self.tok_s, 1), eta_seconds=round(eta, 1) if eta is not None else None)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
