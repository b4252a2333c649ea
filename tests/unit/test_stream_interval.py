"""``stream_interval_ms`` (worker/driver.py): a running job's text deltas are published at most that often,
joined with their token ids; its first text and its end go out at once; 0 publishes every step. The engine
is scripted (its steps' outputs) and the clock is the test's; the events are what the pipeline was given."""

from __future__ import annotations

import json
from unittest.mock import MagicMock

import pytest

from inferq.settings import Settings
from scheduler.request import FinishReason
from worker import driver as driver_mod
from worker.driver import EngineDriver, InFlight
from worker.outputs import RequestOutput, Usage
from worker.streams import Message


class _Pipe:
    """Records the deltas queued on it (``jobs.publish_events`` XADDs, then EXPIREs)."""

    def __init__(self) -> None:
        self.deltas: list[tuple[str, list[int]]] = []

    def xadd(self, key, fields, **kw) -> None:
        data = json.loads(fields["data"])
        self.deltas.append((data["text"], data["token_ids"]))

    def expire(self, *a) -> None:
        pass


def _run(steps: list[tuple[float, RequestOutput]], interval_ms: float, monkeypatch) -> list[tuple[str, list[int]]]:
    engine = MagicMock()
    driver = EngineDriver(engine, Settings(stream_interval_ms=interval_ms), MagicMock(), MagicMock())
    inf = InFlight(job_id="j", rid="j#1", attempt=1, message=Message("s", "1-0", None), tenant_id="t",
                   tier="interactive", enqueued_at=0.0, started_wall=0.0, deadline_unix=None, log=MagicMock())
    driver.inflight[inf.rid] = inf
    pipe = _Pipe()
    clock = iter([t for t, _ in steps for _ in range(2)])  # step() reads the clock twice
    monkeypatch.setattr(driver_mod.time, "monotonic", lambda: next(clock))
    for _, out in steps:
        engine.step.return_value = [out]
        driver.step(pipe)
    return pipe.deltas


def _out(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("j#1", text_delta=text, new_token_ids=ids, finished=finished,
                         finish_reason=FinishReason.STOP if finished else None, text="" if finished else None,
                         usage=Usage() if finished else None)


def test_deltas_are_joined_within_the_interval(monkeypatch) -> None:
    steps = [(0.000, _out("a", [1])),  # the first text: at once
             (0.010, _out("b", [2])),
             (0.020, _out("", [3])),  # no text yet (a character cut in two): its id waits with the rest
             (0.030, _out("c", [4])),
             (0.060, _out("d", [5])),  # 60 ms after the first: the held ones go out with it
             (0.070, _out("e", [6])),
             (0.080, _out("f", [7], finished=True))]  # the end: at once
    assert _run(steps, 50, monkeypatch) == [("a", [1]), ("bcd", [2, 3, 4, 5]), ("ef", [6, 7])]


def test_zero_publishes_every_step(monkeypatch) -> None:
    steps = [(0.001 * i, _out(ch, [i])) for i, ch in enumerate("abc")] + [(0.004, _out("d", [3], finished=True))]
    assert _run(steps, 0, monkeypatch) == [("a", [0]), ("b", [1]), ("c", [2]), ("d", [3])]


@pytest.mark.parametrize("interval_ms", [0, 50])
def test_no_text_is_lost_whatever_the_interval(monkeypatch, interval_ms) -> None:
    text = "the quick brown fox jumps"
    steps = [(0.007 * i, _out(ch, [i], finished=i == len(text) - 1)) for i, ch in enumerate(text)]
    deltas = _run(steps, interval_ms, monkeypatch)
    assert "".join(t for t, _ in deltas) == text
    assert [i for _, ids in deltas for i in ids] == list(range(len(text)))
    assert len(deltas) == (len(text) if interval_ms == 0 else 4)  # at 0, 56 and 112 ms, and the end (168 ms)
