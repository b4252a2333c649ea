"""The worker's Redis side: its consumer group on the job streams of one model, the cancel and new-jobs channels.

Separate from the loop so the queue protocol of docs/SERVICE.md reads in one place:

* the streams: each tier has its own stream plus, under fair share, one lane per tenant
  (``stream_key(..., tenant)``, listed in the tier's lanes set, refreshed every ``LANE_REFRESH_SECONDS``);
* ``read``: only as many messages as the caller has room for: first ``XAUTOCLAIM`` of messages idle longer
  than ``claim_idle_ms`` (their worker is dead), then ``XREADGROUP`` interactive before batch, round-robin
  over a tier's lanes (those of tenants this worker holds fewest jobs of first), so one tenant's backlog does
  not queue another's jobs behind it; plus up to ``newcomers`` jobs of tenants it holds none of, beyond the
  room (the engine's fair share seats them at once); a short BLOCK only when the worker is idle. A busy
  worker skips the lag probe (XINFO GROUPS, a round trip before every step) while its last probe found
  nothing undelivered and no job was announced since on ``new_jobs_channel`` (every enqueue publishes
  there), and probes anyway every ``QUIET_PROBE_SECONDS``, the longest a message added without one waits;
* cache-aware routing (``inferq.routing``): a job may wait in a worker's *routed lane* (listed in the
  tier's routes hash); a worker reads its own routed lanes like any lane, and takes from another worker's
  (``_takeover``) only what ``routing.may_take`` allows: all of it once the owner's registry heartbeat has
  expired, else the messages that waited ``cache_routing_max_wait_ms``; every worker reclaims idle pending
  messages from every routed lane, so a dead owner strands nothing;
* ``decode``: each message becomes a typed ``JobMessage``; malformed ones (or an unknown schema version) go to
  the dead-letter stream and are acknowledged;
* ``keep_alive``: ``XCLAIM ... JUSTID`` resets the idle time of the messages this worker holds, so a live
  worker is never robbed;
* ``ack`` / ``requeue``: XACK + XDEL (+ SREM from the enqueued set) queued on the caller's pipeline, which
  the caller executes only after its database commit (results are committed before the ack);
* ``cancelled_jobs``: job ids published on the cancel channel (pub/sub; resubscribed when lost);
* queue metrics and the worker's stats hash.

The consumer group is created at id 0 and recreated after NOGROUP (e.g. after a FLUSHALL).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis as redis_lib

from inferq import jobs, routing
from inferq.contract import (
    TIERS,
    JobMessage,
    MessageError,
    cancel_channel,
    dead_letter_key,
    lanes_key,
    new_jobs_channel,
    stream_key,
)
from inferq.jobs import routes
from inferq.models_registry import workers_key
from inferq.settings import Settings
from worker.metrics import WorkerMetrics

LANE_REFRESH_SECONDS = 0.1  # how soon a new tenant's lane is read (one SMEMBERS per tier per refresh)
QUIET_PROBE_SECONDS = 0.1  # how often a busy worker told of no new job looks at its streams anyway
DRAIN_MAX = 10_000  # pub/sub messages read per loop iteration at most (cancelled_jobs)
ROUTE_PRUNE_SECONDS = 60.0  # how often a worker removes the empty routed lanes of long-gone workers


@dataclass
class Message:
    """One stream entry this worker read; it stays pending (un-acknowledged) until the job is done with."""

    stream: str
    msg_id: str
    raw: bytes | None
    job: JobMessage | None = None  # set by StreamConsumer.decode
    reclaimed: bool = False
    deleted: bool = False  # XAUTOCLAIM on Redis < 7 returns deleted entries without fields


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class StreamConsumer:
    """Reads, acknowledges and dead-letters the job streams of ``model`` as consumer ``name``."""

    def __init__(self, redis: Any, settings: Settings, model: str, name: str, metrics: WorkerMetrics,
                 log: Any) -> None:
        self.redis = redis
        self.settings = settings
        self.name = name
        self.prefix = settings.stream_prefix
        self.group = settings.consumer_group
        self.model = model
        # per tier (interactive first): the tier's own stream, then its tenant lanes
        self.lanes = {tier: [stream_key(self.prefix, model, tier)] for tier in TIERS}
        # per tier: other workers' routed lanes -> their owner (taken over by _takeover, reclaimed from)
        self.foreign: dict[str, dict[str, str]] = {tier: {} for tier in TIERS}
        self.live: set[str] = set()  # the model's workers whose registry heartbeat is current
        self.metrics = metrics
        self.log = log
        self.pubsub: Any = None
        self.next_autoclaim = 0.0
        self.next_lane_refresh = 0.0
        self.next_route_prune = time.monotonic() + ROUTE_PRUNE_SECONDS
        self.turn = 0  # rotates the lanes' round-robin start, read by read
        # read's probe of the streams (XINFO GROUPS) is skipped while nothing is undelivered and no new job was
        # announced on new_jobs_channel since (heard by cancelled_jobs); it runs anyway once next_probe passes
        self.quiet = False
        self.next_probe = 0.0

    @property
    def streams(self) -> list[str]:
        """Every stream this worker reads, interactive ones first."""
        return [lane for tier in TIERS for lane in self.lanes[tier]]

    @property
    def all_streams(self) -> list[str]:
        """``streams`` plus the other workers' routed lanes (taken over and reclaimed from when due)."""
        return self.streams + [lane for tier in TIERS for lane in self.foreign[tier]]

    def pipeline(self, transaction: bool = False) -> Any:
        return self.redis.pipeline(transaction=transaction)

    # --- set-up and cancellations --------------------------------------------------------------------------

    def ensure_groups(self, streams: Iterable[str] | None = None) -> None:
        for stream in self.all_streams if streams is None else streams:
            try:
                self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except redis_lib.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def refresh_lanes(self, force: bool = False) -> None:
        """Pick up tenant lanes and routed lanes created since the last look (their group starts at id 0:
        nothing is missed), and the live workers."""
        now = time.monotonic()
        if not force and now < self.next_lane_refresh:
            return
        self.next_lane_refresh = now + LANE_REFRESH_SECONDS
        if now >= self.next_route_prune:
            self.next_route_prune = now + ROUTE_PRUNE_SECONDS
            self._prune_routes()
        pipe = self.pipeline()
        for tier in TIERS:
            pipe.smembers(lanes_key(self.prefix, self.model, tier))
            pipe.hgetall(routes.routes_key(self.prefix, self.model, tier))
        pipe.zrangebyscore(workers_key(self.prefix, self.model), time.time(), "+inf")
        res = pipe.execute()
        self.live = set(map(_text, res[-1]))
        for i, tier in enumerate(TIERS):
            members, routed = res[2 * i], {_text(k): _text(v) for k, v in res[2 * i + 1].items()}
            mine = {lane for lane, owner in routed.items() if owner == self.name}
            new = sorted((set(map(_text, members)) | mine) - set(self.lanes[tier]))
            foreign = {lane: owner for lane, owner in routed.items() if owner != self.name}
            fresh = sorted(set(foreign) - set(self.foreign[tier]))
            if new or fresh:
                self.ensure_groups(new + fresh)
            self.lanes[tier] += new
            self.foreign[tier] = foreign

    def _prune_routes(self) -> None:
        """Remove long-gone workers' empty routed lanes (``routes.prune_routes``); a failure only delays it."""
        try:
            pruned = sum(routes.prune_routes(self.redis, self.prefix, self.model, tier) for tier in TIERS)
        except redis_lib.ResponseError as exc:
            self.log.warning("could not prune routed lanes", error=str(exc))
            return
        if pruned:
            self.log.info("pruned the empty routed lanes of gone workers", count=pruned)

    def subscribe(self) -> None:
        try:
            if self.pubsub is not None:
                self.pubsub.close()
            self.pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            self.pubsub.subscribe(cancel_channel(self.prefix), new_jobs_channel(self.prefix, self.model))
            self.quiet = False  # jobs announced before the subscription were not heard
        except redis_lib.RedisError as exc:
            self.pubsub = None
            self.log.warning("cannot subscribe to cancellations (the heartbeat still polls them)", error=str(exc))

    def wake_fd(self) -> int:
        """The pub/sub connection's socket (-1 without one): it turns readable when a job or a cancellation is
        announced, and ``cancelled_jobs`` drains it every loop, so the engine ends a decode-ahead window early
        on it (worker/engine.py ``_plan_ahead``)."""
        sock = getattr(getattr(self.pubsub, "connection", None), "_sock", None)
        try:
            return sock.fileno() if sock is not None else -1
        except OSError:
            return -1

    def cancelled_jobs(self) -> list[str]:
        """Job ids published on the cancel channel since the last call (never blocks); a new job announced on
        ``new_jobs_channel`` meanwhile ends ``read``'s quiet."""
        if self.pubsub is None:
            return []
        job_ids: list[str] = []
        cancels = cancel_channel(self.prefix)
        try:
            for _ in range(DRAIN_MAX):
                msg = self.pubsub.get_message(timeout=0)
                if msg is None:
                    # an ignored subscribe confirmation also reads as None: go on while more is waiting, so
                    # the socket is left quiet (wake_fd: a readable one ends every decode-ahead window early)
                    if self.pubsub.connection is not None and self.pubsub.connection.can_read(timeout=0):
                        continue
                    break
                if msg.get("type") != "message":
                    continue
                if _text(msg.get("channel") or b"") != cancels:  # a new job, on this stream
                    self.quiet = False
                    if _text(msg["data"]) not in self.all_streams:
                        self.next_lane_refresh = 0.0  # a new lane: look it up at the next read
                    continue
                data = msg["data"]
                job_ids.append(data.decode() if isinstance(data, bytes) else str(data))
        except redis_lib.RedisError as exc:
            self.log.warning("cancel subscription lost; resubscribing", error=str(exc))
            self.subscribe()
        return job_ids

    # --- reading ---------------------------------------------------------------------------------------------

    def read(self, n: int, block: bool, held: Callable[[], Iterable[Message]], newcomers: int = 0) -> list[Message]:
        """Up to ``n`` messages: idle ones reclaimed from dead workers (when due; never one in ``held()``, the
        messages this worker holds), then new ones, interactive before batch, round-robin over each tier's
        lanes; then up to ``newcomers`` more from lanes this worker holds nothing of; if there are none and
        ``block``, wait briefly for one."""
        got: list[Message] = []
        try:
            self.refresh_lanes()
            now = time.monotonic()
            if n > 0 and now >= self.next_autoclaim:
                self.next_autoclaim = now + max(0.2, min(self.settings.heartbeat_seconds,
                                                         self.settings.claim_idle_ms / 2000))
                got += self._autoclaim(n, held)
            if not block and self.quiet and self.pubsub is not None and now < self.next_probe:
                return got  # nothing was undelivered at the last probe, and no job was announced since
            load = Counter(m.stream for m in held())
            info = self._group_info() if n > len(got) or newcomers > 0 else {}
            if info:
                self.next_probe = now + QUIET_PROBE_SECONDS
                # quiet only once every stream is known to hold nothing undelivered (lag 0; None: unknown)
                self.quiet = all(lag == 0 for lag, _ in info.values())
            lag = {stream: lag for stream, (lag, _) in info.items()}
            self.turn += 1
            for tier in TIERS:  # interactive first
                want = n - len(got)
                if want <= 0:
                    break
                got += self._read_lanes(self._lane_order(tier, load), want, lag)
                if n - len(got) > 0 and self.foreign[tier]:
                    got += self._takeover(tier, n - len(got), info)
            if newcomers > 0:
                load.update(m.stream for m in got)
                idle = [lane for tier in TIERS for lane in self._lane_order(tier, load)
                        if not load[lane] and lag.get(lane, 1) != 0]
                got += self._read({lane: ">" for lane in idle[:newcomers]}, 1, None) if idle else []
            if not got and block:
                self.refresh_lanes(force=True)
                # short: a lane created while this blocks is only read after it (and the next refresh)
                block_ms = int(max(50, min(100, self.settings.heartbeat_seconds * 500)))
                got += self._read({s: ">" for s in self.streams}, 1, block_ms)
        except redis_lib.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.log.warning("consumer group missing (Redis flushed?); recreating it")
            self.ensure_groups()
        return got

    def _lane_order(self, tier: str, load: Counter) -> list[str]:
        """A tier's lanes, those this worker holds fewest messages of first, rotating among equals."""
        lanes = self.lanes[tier]
        k = self.turn % len(lanes)
        return sorted(lanes[k:] + lanes[:k], key=lambda lane: load[lane])

    def _group_info(self) -> dict[str, tuple[int | None, str | None]]:
        """Per stream (``all_streams``, one round trip of XINFO GROUPS): the entries not yet delivered to the
        group (``lag``; None when Redis cannot say: an undelivered entry was deleted, no group yet, so the
        stream may have some) and the id last delivered."""
        streams = self.all_streams
        pipe = self.pipeline()
        for stream in streams:
            pipe.xinfo_groups(stream)
        info: dict[str, tuple[int | None, str | None]] = {}
        for stream, groups in zip(streams, pipe.execute(raise_on_error=False), strict=True):
            mine = [g for g in groups if _text(g["name"]) == self.group] if isinstance(groups, list) else []
            last = mine[0].get("last-delivered-id") if mine else None
            info[stream] = (mine[0].get("lag") if mine else None, _text(last) if last is not None else None)
        return info

    def _takeover(self, tier: str, want: int, info: Mapping[str, tuple[int | None, str | None]]) -> list[Message]:
        """Up to ``want`` messages from other workers' routed lanes of ``tier`` that ``routing.may_take``
        allows: any undelivered one when the owner is gone, else those that waited the bound (the oldest
        undelivered entries, whose ids carry their enqueue time; Redis's clock, so skew cannot matter)."""
        candidates = [(lane, owner) for lane, owner in self.foreign[tier].items() if info.get(lane, (None, None))[0] != 0]
        if not candidates:
            return []
        for lane, _ in candidates:
            if info.get(lane, (None, None)) == (None, None):  # no group: a pruned lane written to again
                try:
                    self.redis.xgroup_create(lane, self.group, id="0")
                except redis_lib.ResponseError:  # BUSYGROUP, or the lane is gone (no stream is created)
                    pass
        pipe = self.pipeline()
        pipe.time()
        for lane, _ in candidates:
            last = info.get(lane, (None, None))[1] or "0-0"
            pipe.xrange(lane, min=f"({last}", count=want)
        res = pipe.execute(raise_on_error=False)
        if not isinstance(res[0], (list, tuple)):
            return []
        now_ms = int(res[0][0]) * 1000 + int(res[0][1]) // 1000
        wait_s = self.settings.cache_routing_max_wait_ms / 1000
        out: list[Message] = []
        for (lane, owner), entries in zip(candidates, res[1:], strict=True):
            if not isinstance(entries, list) or len(out) >= want:
                continue
            ages = [(now_ms - int(_text(mid).split("-")[0])) / 1000 for mid, _ in entries]
            count = sum(1 for age in ages if routing.may_take(owner in self.live, age, wait_s))
            count = min(count, want - len(out))
            if count > 0:
                out += self._read({lane: ">"}, count, None)
        if out:
            self.metrics.routed_taken_over.inc(len(out))
        return out

    def _read_lanes(self, lanes: list[str], want: int, lag: Mapping[str, int | None]) -> list[Message]:
        """Up to ``want`` messages, as evenly over ``lanes`` as they have them: shares dealt one at a time in
        ``lanes`` order, each lane capped by its lag, then one XREADGROUP per distinct share."""
        share: Counter = Counter()
        open_lanes = [lane for lane in lanes if lag.get(lane) != 0]
        left = want
        while left > 0 and open_lanes:
            for lane in list(open_lanes):
                if left == 0:
                    break
                share[lane] += 1
                left -= 1
                known = lag.get(lane)
                if known is not None and share[lane] >= known:
                    open_lanes.remove(lane)
        by_count: dict[int, list[str]] = {}
        for lane, count in share.items():
            by_count.setdefault(count, []).append(lane)
        return [m for count, group in by_count.items() for m in self._read({lane: ">" for lane in group}, count, None)]

    def _read(self, streams: dict[str, str], count: int, block: int | None) -> list[Message]:
        resp = self.redis.xreadgroup(self.group, self.name, streams, count=count, block=block)
        out = []
        for stream, entries in resp or []:
            for mid, fields in entries:
                out.append(Message(_text(stream), _text(mid), (fields or {}).get(b"m")))
        return out

    def _autoclaim(self, n: int, held: Callable[[], Iterable[Message]]) -> list[Message]:
        mine = {(m.stream, m.msg_id) for m in held()}
        out: list[Message] = []
        streams = self.all_streams  # another worker's routed lane too: its owner may be dead
        pipe = self.pipeline()
        for stream in streams:  # one round trip to find the streams with pending messages at all
            pipe.xpending(stream, self.group)
        pending = pipe.execute(raise_on_error=False)
        for stream, summary in zip(streams, pending, strict=True):
            if not isinstance(summary, dict) or not summary.get("pending"):
                continue
            if len(out) >= n:
                break
            resp = self.redis.xautoclaim(stream, self.group, self.name, self.settings.claim_idle_ms,
                                         start_id="0-0", count=n - len(out))
            for mid, fields in resp[1]:
                mid = _text(mid)
                if (stream, mid) in mine:
                    continue
                out.append(Message(stream, mid, (fields or {}).get(b"m"), reclaimed=True, deleted=fields is None))
        if out:
            self.metrics.reclaimed.inc(len(out))
            self.log.info("reclaimed idle messages", count=len(out))
        return out

    def decode(self, msgs: list[Message]) -> list[Message]:
        """Decode each message into ``Message.job``; returns the good ones. Deleted entries are acknowledged,
        malformed ones dead-lettered (stream, msg_id, error, raw ``m``) and acknowledged."""
        pipe = self.pipeline()
        good: list[Message] = []
        bad = 0
        for m in msgs:
            if m.deleted:
                bad += 1
                self.ack(pipe, m, None)
                continue
            try:
                if m.raw is None:
                    raise MessageError("no 'm' field")
                m.job = JobMessage.decode(m.raw)
            except MessageError as exc:
                bad += 1
                self.metrics.dead_letters.inc()
                self.log.error("malformed message dead-lettered", stream=m.stream, msg_id=m.msg_id, error=str(exc))
                pipe.xadd(dead_letter_key(self.prefix), {"stream": m.stream, "msg_id": m.msg_id, "error": str(exc),
                                                          "worker": self.name, "m": m.raw or b""})
                self.ack(pipe, m, None)
                continue
            good.append(m)
        if bad:
            pipe.execute()
        return good

    # --- holding, acknowledging, giving back ----------------------------------------------------------------

    def keep_alive(self, held: Iterable[Message]) -> None:
        """Reset the idle time of the held messages: XAUTOCLAIM elsewhere must not take them."""
        by_stream: dict[str, list[str]] = {}
        for m in held:
            by_stream.setdefault(m.stream, []).append(m.msg_id)
        for stream, ids in by_stream.items():
            try:
                self.redis.xclaim(stream, self.group, self.name, 0, ids, justid=True)
            except redis_lib.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    self.ensure_groups()

    def ack(self, pipe: Any, m: Message, job_id: str | None) -> None:
        """Queue XACK + XDEL (the stream holds only unfinished messages) and, for a finished job, its SREM from
        the enqueued set."""
        pipe.xack(m.stream, self.group, m.msg_id)
        pipe.xdel(m.stream, m.msg_id)
        if job_id:
            pipe.srem(jobs.enqueued_key(self.prefix), job_id)

    def requeue(self, pipe: Any, m: Message, job_id: str | None) -> None:
        """Queue a fresh copy of the message (plus the job's enqueued-set entry when ``job_id``) and the ack of
        this one: a job given back at shutdown."""
        pipe.xadd(m.stream, {"m": m.raw})
        tier = self._tier_of(m.stream)
        if tier is not None:
            pipe.publish(new_jobs_channel(self.prefix, self.model), m.stream)
        if routing.ROUTE_SEPARATOR in m.stream and tier is not None:
            routes.register_routed(pipe, self.prefix, self.model, tier, m.stream)
        if job_id:
            pipe.sadd(jobs.enqueued_key(self.prefix), job_id)
        self.ack(pipe, m, None)

    def _tier_of(self, stream: str) -> str | None:
        """The tier a stream of this model belongs to (its own stream, a tenant lane or a routed lane)."""
        for tier in TIERS:
            if stream.startswith(stream_key(self.prefix, self.model, tier)):
                return tier
        return None

    # --- numbers -----------------------------------------------------------------------------------------------

    def write_stats(self, mapping: Mapping[str, Any], pipe: Any = None) -> None:
        """The worker's live numbers in ``jobs.worker_key`` (a Redis hash, kept a day); on ``pipe`` if given."""
        key = jobs.worker_key(self.prefix, self.name)
        try:
            p = pipe if pipe is not None else self.pipeline()
            p.hset(key, mapping=dict(mapping))
            p.expire(key, 86400)
            if pipe is None:
                p.execute()
        except redis_lib.RedisError as exc:
            self.log.warning("cannot write worker stats", error=str(exc))

    def queue_metrics(self) -> None:
        """Depth, pending, backlog (not yet delivered) and oldest age per tier, summed over all its lanes,
        routed ones included (labelled with the tier's stream)."""
        streams = self.all_streams
        try:
            pipe = self.pipeline()
            for stream in streams:
                pipe.xlen(stream)
                pipe.xrange(stream, count=1)
                pipe.xpending(stream, self.group)
            res = pipe.execute(raise_on_error=False)
        except redis_lib.RedisError:
            return
        now_ms = time.time() * 1000
        by_stream = {stream: res[3 * i: 3 * i + 3] for i, stream in enumerate(streams)}
        for tier in TIERS:
            depth = pending = 0
            oldest: int | None = None
            for lane in [*self.lanes[tier], *self.foreign[tier]]:
                d, first, p = by_stream[lane]
                depth += d if isinstance(d, int) else 0
                pending += p.get("pending", 0) if isinstance(p, dict) else 0
                if isinstance(first, list) and first:
                    ms = int(_text(first[0][0]).split("-")[0])
                    oldest = ms if oldest is None else min(oldest, ms)
            label = self.lanes[tier][0]
            self.metrics.queue_depth.labels(label).set(depth)
            self.metrics.queue_pending.labels(label).set(pending)
            self.metrics.queue_backlog.labels(label).set(max(0, depth - pending))
            self.metrics.queue_oldest_age.labels(label).set(0.0 if oldest is None else max(0.0, (now_ms - oldest) / 1000))
