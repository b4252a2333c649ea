"""Webhooks: URL safety checks, signing, and the delivery loop.

When a job with a ``webhook_url`` reaches a terminal status, its GET-job JSON is POSTed to the URL with

    X-Inferq-Timestamp: <unix seconds>
    X-Inferq-Signature: hex(HMAC-SHA256(tenant.webhook_secret, f"{timestamp}.{body}"))

All delivery state lives in ``webhook_deliveries`` so redelivery survives restarts:

1. *enqueue*: terminal jobs with a webhook URL and no delivery row get one (one statement,
   ``INSERT .. SELECT .. WHERE NOT EXISTS``, serialised across processes by a PostgreSQL advisory lock);
2. *claim*: pending rows with ``next_attempt_at <= now`` are locked with ``FOR UPDATE SKIP LOCKED`` and
   leased (``next_attempt_at`` moved past the HTTP timeout), so any number of dispatchers can run and a
   crashed one's rows come back after the lease;
3. *deliver*: POST; 2xx → delivered; otherwise the attempt is recorded (``attempts``, ``history``,
   ``last_status_code``, ``last_error``) and retried after exponential backoff with jitter, until
   ``settings.webhook_max_attempts`` → failed.

Between rounds it sleeps until a job with a webhook finishes (a PostgreSQL ``NOTIFY`` from a trigger on
``jobs``) or a retry falls due, polling only as a backstop (``api/webhook_wakeups.py``).

The dispatcher runs as a background thread in the API process (``create_app(webhooks=True)``, the
default for ``inferq api``) or alone (``inferq webhooks``); never inside the engine's step loop.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import random
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import and_, exists, insert, literal, or_, select, text
from sqlalchemy.orm import sessionmaker

from api.metrics import WEBHOOK_ATTEMPTS
from api.views import full_view
from api.webhook_wakeups import Wakeups
from inferq.db import TERMINAL_STATUSES, Job, Tenant, WebhookDelivery, utcnow
from inferq.log import get_logger
from inferq.settings import Settings

log = get_logger("inferq.webhooks")

SIGNATURE_HEADER = "X-Inferq-Signature"
TIMESTAMP_HEADER = "X-Inferq-Timestamp"
MAX_BACKOFF_SECONDS = 3600.0
_ADVISORY_LOCK_KEY = 0x1F0E_5EB0  # serialises the enqueue scan across dispatchers (PostgreSQL)


# --- URL safety ------------------------------------------------------------------------------------

class UnsafeURL(ValueError):
    """A webhook URL that is malformed or points at a non-public address."""


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _allowed(host: str, addrs: list[IPAddress], allowlist: list[str]) -> bool:
    host = host.lower().rstrip(".")
    nets = []
    for entry in allowlist:
        entry = entry.strip().lower()
        if not entry:
            continue
        if entry == host:
            return True
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            continue
    return bool(addrs) and bool(nets) and all(any(a in n for n in nets if a.version == n.version) for a in addrs)


# IPv6 forms that carry an IPv4 address a gateway will reach: NAT64 (RFC 6052 well-known prefix, RFC 8215
# local-use prefix) and IPv4-compatible addresses (::a.b.c.d, deprecated but still routed by some stacks)
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_V4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(addr: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address leads to: mapped, 6to4, Teredo (server and client), NAT64,
    IPv4-compatible. A webhook to any of them reaches that IPv4 host, so each must be public too."""
    found = [a for a in (addr.ipv4_mapped, addr.sixtofour) if a is not None]
    if addr.teredo is not None:
        found.extend(addr.teredo)
    if any(addr in net for net in _NAT64) or (addr in _V4_COMPATIBLE and int(addr) > 1):
        found.append(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    return found


def _public(addr: IPAddress) -> bool:
    if isinstance(addr, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(addr)
        if embedded:
            return all(_public(a) for a in embedded)
    return addr.is_global and not addr.is_multicast


def resolve(host: str, port: int) -> list[IPAddress]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, OSError) as exc:
        raise UnsafeURL(f"host {host!r} does not resolve ({exc})") from exc
    out: list[IPAddress] = []
    for info in infos:
        try:
            out.append(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
        except ValueError:
            continue
    if not out:
        raise UnsafeURL(f"host {host!r} does not resolve")
    return out


def check_webhook_url(url: str, allowlist: list[str]) -> None:
    """Raise UnsafeURL unless ``url`` is http(s) and every address its host resolves to is public or
    allow-listed (``settings.allowlist``: host names or CIDRs)."""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise UnsafeURL("must not contain whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeURL(f"not a valid URL ({exc})") from exc
    if parts.scheme not in ("http", "https"):
        raise UnsafeURL("must be an http or https URL")
    host = parts.hostname
    if not host:
        raise UnsafeURL("must name a host")
    port = port or (443 if parts.scheme == "https" else 80)
    allowlist = [h.lower() for h in allowlist]
    if host.lower().rstrip(".") in allowlist:
        return
    addrs = resolve(host, port)
    if _allowed(host, addrs, allowlist):
        return
    bad = [str(a) for a in addrs if not _public(a)]
    if bad:
        raise UnsafeURL(f"host {host!r} resolves to a loopback, private, link-local or otherwise non-public "
                        f"address ({', '.join(sorted(set(bad)))}); add it to INFERQ_WEBHOOK_ALLOWLIST to allow it")


# --- signing ---------------------------------------------------------------------------------------

def sign(secret: str, timestamp: int | str, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def verify(secret: str, timestamp: str, body: bytes, signature: str, tolerance_seconds: float = 300.0,
           now: float | None = None) -> bool:
    """What a receiver does: recompute the signature and refuse stale timestamps (replays)."""
    try:
        ts = int(timestamp)
    except (TypeError, ValueError):
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_seconds:
        return False
    return hmac.compare_digest(sign(secret, ts, body), signature)


def backoff_seconds(attempt: int, base: float, cap: float = MAX_BACKOFF_SECONDS) -> float:
    """Delay before retry number ``attempt`` (1-based): exponential, with "equal jitter" (half fixed,
    half random) so retries of many deliveries spread out."""
    delay = min(cap, base * (2 ** max(0, attempt - 1)))
    return delay / 2 + random.uniform(0, delay / 2)


# --- delivery loop -----------------------------------------------------------------------------------

_DELIVERY_NAMESPACE = uuid.UUID("6f1d3c52-7f0e-4b8e-9a51-2c1f0b7d9e43")  # fixed: ids must not change


def delivery_id(job_id: str, row_id: int) -> str:
    """The ``X-Inferq-Delivery`` id: a UUID, the same on every retry of one delivery (receivers de-duplicate
    on it) and unique across restarts, databases and deployments, because it is derived from the job id (a
    random UUID) and not only from the delivery row's counter, which a fresh database starts again at 1."""
    return str(uuid.uuid5(_DELIVERY_NAMESPACE, f"{job_id}/{row_id}"))


@dataclass
class Claimed:
    id: int
    job_id: str
    url: str
    attempts: int


class WebhookDispatcher:
    def __init__(self, settings: Settings, session_factory: sessionmaker, *, batch_size: int = 32,
                 poll_interval: float = 0.5, idle_seconds: float = 5.0, lookback_seconds: float = 7 * 86400,
                 concurrency: int = 8, transport: httpx.BaseTransport | None = None) -> None:
        self.settings = settings
        self.session_factory = session_factory
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.lookback = timedelta(seconds=lookback_seconds)
        self.lease = timedelta(seconds=settings.webhook_timeout_seconds * 2 + 30)
        self.client = httpx.Client(timeout=settings.webhook_timeout_seconds, follow_redirects=False,
                                   transport=transport, headers={"User-Agent": "inferq-webhooks/1"})
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="inferq-webhook")
        self.wakeups = Wakeups(session_factory, idle_seconds)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def _postgres(self) -> bool:
        return self.session_factory.kw["bind"].dialect.name == "postgresql"

    # 1. create delivery rows for newly terminal jobs
    def enqueue_new(self) -> int:
        now = utcnow()
        with self.session_factory() as s, s.begin():
            if self._postgres and not s.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": _ADVISORY_LOCK_KEY}):
                return 0
            pending = (
                select(Job.id, Job.webhook_url, literal("pending"), literal(0), literal(now), literal(now))
                .where(
                    Job.webhook_url.is_not(None),
                    Job.status.in_(sorted(TERMINAL_STATUSES)),
                    or_(Job.finished_at.is_(None), Job.finished_at >= now - self.lookback),
                    ~exists().where(WebhookDelivery.job_id == Job.id),
                )
            )
            result = s.execute(
                insert(WebhookDelivery).from_select(
                    ["job_id", "url", "status", "attempts", "next_attempt_at", "created_at"], pending
                )
            )
            return result.rowcount or 0

    # 2. claim due deliveries under a lease
    def claim(self) -> list[Claimed]:
        now = utcnow()
        with self.session_factory() as s, s.begin():
            rows = list(s.scalars(
                select(WebhookDelivery)
                .where(and_(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now))
                .order_by(WebhookDelivery.next_attempt_at)
                .limit(self.batch_size)
                .with_for_update(skip_locked=True)
            ))
            for d in rows:
                d.next_attempt_at = now + self.lease
            return [Claimed(d.id, d.job_id, d.url, d.attempts) for d in rows]

    # 3. one attempt
    def deliver(self, claimed: Claimed) -> str:
        started = time.monotonic()
        status_code: int | None = None
        error: str | None = None
        permanent = False
        with self.session_factory() as s:
            job = s.get(Job, claimed.job_id)
            tenant = s.get(Tenant, job.tenant_id) if job is not None else None
            body = json.dumps(full_view(s, job), separators=(",", ":")).encode() if job is not None else b""
        if job is None or tenant is None:
            error, permanent = "job no longer exists", True
        else:
            try:
                check_webhook_url(claimed.url, self.settings.allowlist)  # again: DNS may have changed
            except UnsafeURL as exc:
                error, permanent = f"refused: {exc}", True
        if error is None and tenant is not None:
            ts = int(time.time())
            headers = {
                "Content-Type": "application/json",
                TIMESTAMP_HEADER: str(ts),
                SIGNATURE_HEADER: sign(tenant.webhook_secret, ts, body),
                "X-Inferq-Delivery": delivery_id(claimed.job_id, claimed.id),
                "X-Inferq-Job": claimed.job_id,
                "X-Inferq-Attempt": str(claimed.attempts + 1),
            }
            try:
                resp = self.client.post(claimed.url, content=body, headers=headers)
                status_code = resp.status_code
                if not 200 <= status_code < 300:
                    error = f"receiver answered HTTP {status_code}"
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"[:500] or type(exc).__name__
        return self._record(claimed, status_code, error, permanent, time.monotonic() - started)

    def _record(self, claimed: Claimed, status_code: int | None, error: str | None, permanent: bool,
                seconds: float) -> str:
        now = utcnow()
        with self.session_factory() as s, s.begin():
            d = s.get(WebhookDelivery, claimed.id, with_for_update=True)
            if d is None:
                return "gone"
            d.attempts = (d.attempts or 0) + 1
            d.last_status_code = status_code
            d.last_error = error
            entry = {"attempt": d.attempts, "at": now.isoformat(), "status_code": status_code, "error": error,
                     "seconds": round(seconds, 4)}
            d.history = [*(d.history or []), entry]
            if error is None:
                d.status, d.delivered_at, d.next_attempt_at = "delivered", now, None
            elif permanent or d.attempts >= self.settings.webhook_max_attempts:
                d.status, d.next_attempt_at = "failed", None
            else:
                d.next_attempt_at = now + timedelta(
                    seconds=backoff_seconds(d.attempts, self.settings.webhook_backoff_base_seconds))
            outcome = d.status if d.status != "pending" else "retry"
        WEBHOOK_ATTEMPTS.labels(outcome).inc()
        log.info("webhook attempt", job_id=claimed.job_id, delivery=claimed.id, attempt=claimed.attempts + 1,
                 status_code=status_code, error=error, outcome=outcome)
        return outcome

    def run_once(self) -> int:
        """Enqueue, claim and deliver one batch; returns the number of attempts made."""
        self.enqueue_new()
        claimed = self.claim()
        if claimed:
            list(self.pool.map(self._safe_deliver, claimed))
        return len(claimed)

    def _safe_deliver(self, claimed: Claimed) -> str:
        try:
            return self.deliver(claimed)
        except Exception as exc:  # the lease brings the row back; keep the loop alive
            log.warning("webhook delivery crashed", delivery=claimed.id, error=repr(exc)[:300])
            return "error"

    def run(self, stop: threading.Event | None = None) -> None:
        """Rounds until ``stop``: after a round that found work for less than a batch, wait for the next job
        with a webhook to finish or retry to fall due (``api/webhook_wakeups.py``; polling where there is no
        PostgreSQL); after an error, back off."""
        stop = stop or self._stop
        backoff = self.poll_interval
        try:
            while not stop.is_set():
                try:
                    n = self.run_once()
                    backoff = self.poll_interval
                except Exception as exc:  # DB down: keep trying, slower
                    log.warning("webhook dispatcher error", error=repr(exc)[:300])
                    backoff = min(backoff * 2, 30.0)
                    stop.wait(backoff)
                    continue
                if n < self.batch_size:
                    self.wakeups.wait(self.poll_interval, stop)
        finally:
            self.wakeups.close()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="inferq-webhooks", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def deliveries_for(session_factory: sessionmaker, job_id: str) -> list[dict[str, Any]]:
    """Delivery rows of a job, for tests and the CLI; ``id`` is the delivery id receivers see."""
    with session_factory() as s:
        return [
            {"id": delivery_id(d.job_id, d.id), "url": d.url, "status": d.status, "attempts": d.attempts,
             "last_status_code": d.last_status_code, "last_error": d.last_error, "history": d.history or []}
            for d in s.scalars(select(WebhookDelivery).where(WebhookDelivery.job_id == job_id))
        ]
