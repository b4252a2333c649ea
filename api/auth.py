"""Bearer API keys: ``Authorization: Bearer iq_...``. The key's sha256 is looked up in ``api_keys``;
revoked keys and keys of deleted tenants are rejected. Valid lookups are cached for a few seconds per
process (``auth_cache_seconds``) so submission does not pay a query per request; a revocation therefore
takes effect within that time."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError, unauthorized
from api.tenants import hash_key
from inferq.db import ApiKey, Tenant
from inferq.jobs.pg_admission import detached_instance, pooled_connection

bearer = HTTPBearer(auto_error=False, scheme_name="ApiKey",
                    description="An API key from `inferq keys create TENANT`, sent as `Authorization: Bearer <key>`.")


@dataclass(frozen=True)
class Principal:
    tenant: Tenant  # detached ORM object (id, name, cache_namespace, webhook_secret, quotas)
    key_prefix: str
    is_admin: bool

    @property
    def tenant_id(self) -> str:
        return self.tenant.id


class KeyCache:
    def __init__(self, ttl: float, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def get(self, key_hash: str) -> Principal | None:
        if self.ttl <= 0:
            return None
        hit = self._entries.get(key_hash)
        if hit is None or hit[0] < time.monotonic():
            return None
        return hit[1]

    def put(self, key_hash: str, principal: Principal) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[key_hash] = (time.monotonic() + self.ttl, principal)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


# the key and its tenant in one round trip on an admission connection (api/auth.py's lookup_key says why)
_PG_LOOKUP = """
SELECT k.prefix, k.is_admin, k.revoked_at, t.id, t.name, t.cache_namespace, t.webhook_secret, t.max_queued_jobs,
       t.tokens_per_minute, t.fair_share_weight, t.created_at
FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE k.key_hash = %s
"""
_TENANT_COLUMNS = ("id", "name", "cache_namespace", "webhook_secret", "max_queued_jobs", "tokens_per_minute",
                   "fair_share_weight", "created_at")


def lookup_key(session_factory: sessionmaker, key: str) -> Principal | None:
    """The principal for a full API key, or None when unknown or revoked. On PostgreSQL one pipelined round trip
    on an admission connection (the first request after ``auth_cache_seconds`` idle pays this lookup: through
    an ORM session it was a pool ping, BEGIN, the query and a ROLLBACK, 4-10 ms on a 2-core VM); elsewhere
    through the ORM."""
    if not key or len(key) > 200:
        return None
    engine = session_factory.kw.get("bind")
    if engine is not None and engine.dialect.name == "postgresql":
        return _lookup_postgres(engine, hash_key(key))
    return _lookup_orm(session_factory, hash_key(key))


def _lookup_orm(session_factory: sessionmaker, key_hash: str) -> Principal | None:
    with session_factory() as s:
        row = s.execute(
            select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.key_hash == key_hash)
        ).first()
        if row is None or row[0].revoked_at is not None:
            return None
        s.expunge(row[1])
        return Principal(tenant=row[1], key_prefix=row[0].prefix, is_admin=bool(row[0].is_admin))


def _lookup_postgres(engine: Any, key_hash: str) -> Principal | None:
    with pooled_connection(engine) as conn:
        with conn.pipeline():
            cur = conn.execute(_PG_LOOKUP, (key_hash,))
            conn.rollback()
        row = cur.fetchone()
    if row is None or row[2] is not None:
        return None
    tenant = detached_instance(Tenant, **dict(zip(_TENANT_COLUMNS, row[3:], strict=True)))
    return Principal(tenant=tenant, key_prefix=row[0], is_admin=bool(row[1]))


async def authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    """Cache hit: no thread hop and no query (the common case on the submission path)."""
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise unauthorized("missing API key: send `Authorization: Bearer <key>`")
    key = credentials.credentials.strip()
    state = request.app.state.inferq
    key_hash = hash_key(key)
    principal = state.key_cache.get(key_hash)
    if principal is None:
        principal = await run_in_threadpool(lookup_key, state.session_factory, key)
        if principal is None:
            raise unauthorized("invalid or revoked API key")
        state.key_cache.put(key_hash, principal)
    return principal


class _ApiKeyBearer(HTTPBearer):
    """The bearer scheme that also authenticates: one dependency per request instead of two (FastAPI's
    dependency solving is a measurable part of a submission's CPU), the same OpenAPI security scheme, and
    still solved before the body is validated (so a request without a valid key is a 401, never a 422)."""

    async def __call__(self, request: Request) -> Principal:  # type: ignore[override]
        return await authenticate(request, await super().__call__(request))


require_key = _ApiKeyBearer(auto_error=False, scheme_name=bearer.scheme_name, description=bearer.model.description)


def require_admin(principal: Principal = Depends(require_key)) -> Principal:
    if not principal.is_admin:
        # an ordinary key must not learn that admin endpoints exist: treat as not found
        raise ApiError(404, "not_found", "not found")
    return principal
