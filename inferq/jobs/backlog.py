"""The autoscaling signal of one model's tier, read from Redis: what waits, what is held, how long the oldest
waiting job has waited, and how many engine seats the live workers have busy. ``/readyz`` reports it per
model and tier; the workers export the same numbers as Prometheus gauges (``worker/metrics.py``).

Every stream of the tier counts: its own stream, the tenant lanes and the routed lanes (``tier_streams``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from inferq.contract import TIERS
from inferq.jobs.enqueue import tier_streams
from inferq.jobs.lifecycle import worker_key


@dataclass(frozen=True)
class TierQueue:
    """``backlog``: messages not yet delivered to any worker (what more workers would take); ``pending``:
    delivered and not yet acknowledged (running or about to); ``oldest_waiting_seconds``: the age of the
    oldest undelivered message (0 when none); ``busy_seats`` / ``seats``: engine seats running a request of
    this tier / all seats, summed over the given workers."""

    backlog: int
    pending: int
    oldest_waiting_seconds: float
    busy_seats: int
    seats: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _ms(entry_id: Any) -> int:
    return int(_text(entry_id).split("-")[0])


def tier_queue(redis: Any, prefix: str, group: str, model: str, tier: str, workers: list[str]) -> TierQueue:
    """The tier's numbers (three round trips: the streams, their groups, the oldest undelivered entries)."""
    streams = tier_streams(redis, prefix, model, tier)
    pipe = redis.pipeline(transaction=False)
    pipe.time()
    for stream in streams:
        pipe.xinfo_groups(stream)
        pipe.xlen(stream)
    res = pipe.execute(raise_on_error=False)
    now_ms = int(res[0][0]) * 1000 + int(res[0][1]) // 1000
    backlog = pending = 0
    lasts: list[tuple[str, str]] = []
    for i, stream in enumerate(streams):
        groups, length = res[1 + 2 * i], res[2 + 2 * i]
        length = length if isinstance(length, int) else 0
        mine = [g for g in groups if _text(g["name"]) == group] if isinstance(groups, list) else []
        if not mine:  # no worker has read it yet: everything in it waits
            backlog += length
            lasts.append((stream, "0-0"))
            continue
        held = int(mine[0].get("pending") or 0)
        lag = mine[0].get("lag")
        pending += held
        backlog += int(lag) if lag is not None else max(0, length - held)
        lasts.append((stream, _text(mine[0].get("last-delivered-id") or "0-0")))
    pipe = redis.pipeline(transaction=False)
    for stream, last in lasts:
        pipe.xrange(stream, min=f"({last}", count=1)
    heads = [h[0][0] for h in pipe.execute(raise_on_error=False) if isinstance(h, list) and h]
    oldest = max(0.0, (now_ms - min(map(_ms, heads))) / 1000) if heads else 0.0
    busy, seats = _seats(redis, prefix, tier, workers)
    return TierQueue(backlog=backlog, pending=pending, oldest_waiting_seconds=round(oldest, 3), busy_seats=busy,
                     seats=seats)


def _seats(redis: Any, prefix: str, tier: str, workers: list[str]) -> tuple[int, int]:
    """(busy seats of ``tier``, all seats) over ``workers``' stats hashes (written with each heartbeat)."""
    if not workers:
        return 0, 0
    pipe = redis.pipeline(transaction=False)
    for w in workers:
        pipe.hmget(worker_key(prefix, w), [f"busy_seats:{tier}", "seats"])
    busy = seats = 0
    for values in pipe.execute():
        b, s = (int(_text(v)) if v is not None and _text(v).isdigit() else 0 for v in values)
        busy, seats = busy + b, seats + s
    return busy, seats


def model_queues(redis: Any, prefix: str, group: str, serving: dict[str, list[str]]) -> dict[str, dict[str, dict]]:
    """Every model of ``serving`` (model -> its live workers) -> tier -> ``TierQueue.as_dict()``."""
    return {model: {tier: tier_queue(redis, prefix, group, model, tier, workers).as_dict() for tier in TIERS}
            for model, workers in serving.items()}
