"""Cache-aware routing, the Redis side: which workers are live, whose routed lane a job goes to, and the
index of routed lanes the workers read (the choice itself is ``inferq.routing``, pure).

* live workers: the model registry's ``model-workers`` sorted set (each worker's heartbeat extends its
  score; ``inferq.models_registry``), read at most once per ``LIVE_CACHE_SECONDS`` per process, since every
  submission asks and a second of staleness only costs a job the wait of ``may_take``;
* ``routes_key(prefix, model, tier)`` (hash): routed lane -> its owner's worker name, so that every worker
  finds every routed lane (its own to read, the others' to take over and to reclaim from).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from inferq import routing
from inferq.models_registry import workers_key
from inferq.settings import Settings

LIVE_CACHE_SECONDS = 1.0

_live_cache: dict[tuple[int, str, str], tuple[float, list[str]]] = {}
_live_lock = threading.Lock()


def routes_key(prefix: str, model: str, tier: str) -> str:
    """Redis hash of a model's tier: routed lane (stream key) -> the worker that owns it."""
    return f"{prefix}:routes:{model}:{tier}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def read_live_workers(redis: Any, prefix: str, model: str, since: float | None = None) -> list[str]:
    """The workers whose registry heartbeat is current (uncached); with ``since``, those live at any time
    since then."""
    since = time.time() if since is None else since
    return sorted(_text(w) for w in redis.zrangebyscore(workers_key(prefix, model), since, "+inf"))


def live_workers(redis: Any, prefix: str, model: str) -> list[str]:
    """``read_live_workers``, cached per process for ``LIVE_CACHE_SECONDS``."""
    key = (id(redis), prefix, model)
    now = time.monotonic()
    with _live_lock:
        hit = _live_cache.get(key)
    if hit is not None and now - hit[0] < LIVE_CACHE_SECONDS:
        return hit[1]
    workers = read_live_workers(redis, prefix, model)
    with _live_lock:
        if len(_live_cache) > 256:
            _live_cache.clear()
        _live_cache[key] = (now, workers)
    return workers


def config_of(settings: Settings) -> routing.RoutingConfig:
    return routing.RoutingConfig(prefix_chars=settings.cache_routing_prefix_chars,
                                 prefix_tokens=settings.cache_routing_prefix_tokens)


def choose_owner(redis: Any, settings: Settings, model: str, request: dict[str, Any], cache_namespace: str) -> str | None:
    """The worker a job is routed to, or None (routing off, fewer than two live workers, or no prompt): then
    the job goes to its shared lane as without routing. A Redis error here only costs the routing."""
    if not settings.cache_routing:
        return None
    try:
        workers = live_workers(redis, settings.stream_prefix, model)
    except Exception:
        return None
    if len(workers) < 2:
        return None
    return routing.owner(routing.routing_key(request, cache_namespace, config_of(settings)), workers)


def push_routed(pipe: Any, prefix: str, model: str, tier: str, lane: str, owner: str, payload: bytes) -> str:
    """Queue the XADD of ``payload`` to ``owner``'s routed lane of ``lane`` and register that lane; returns the
    routed lane."""
    routed = routing.routed_lane(lane, owner)
    pipe.xadd(routed, {"m": payload})
    pipe.hset(routes_key(prefix, model, tier), routed, owner)
    return routed


def routed_lanes(redis: Any, prefix: str, model: str, tier: str) -> dict[str, str]:
    """Every routed lane of a tier -> its owner."""
    return {_text(k): _text(v) for k, v in redis.hgetall(routes_key(prefix, model, tier)).items()}


PRUNE_AFTER_SECONDS = 600.0  # a routed lane whose owner has not beaten this long is removed once empty

# Atomic against enqueueing (whose XADD + HSET is one MULTI): a lane is removed only while it has no entry,
# and a later XADD re-creates and re-registers it.
_PRUNE_EMPTY = """
if redis.call('XLEN', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HDEL', KEYS[2], KEYS[1])
  return 1
end
return 0
"""


def prune_routes(redis: Any, prefix: str, model: str, tier: str, now: float | None = None) -> int:
    """Remove the empty routed lanes of workers gone for ``PRUNE_AFTER_SECONDS`` (worker names are new at
    every start, so their lanes would otherwise pile up, each read by every worker); returns how many."""
    recent = set(read_live_workers(redis, prefix, model, (time.time() if now is None else now) - PRUNE_AFTER_SECONDS))
    key = routes_key(prefix, model, tier)
    dead = [lane for lane, owner in routed_lanes(redis, prefix, model, tier).items() if owner not in recent]
    return sum(int(redis.eval(_PRUNE_EMPTY, 2, lane, key)) for lane in dead)


def register_routed(pipe: Any, prefix: str, model: str, tier: str, lane: str) -> None:
    """Queue the (re-)registration of a routed lane written to outside ``push_routed`` (a job handed back to
    the lane it came from, which may have been pruned meanwhile)."""
    owner = lane.rpartition(routing.ROUTE_SEPARATOR)[2]
    pipe.hset(routes_key(prefix, model, tier), lane, owner)
