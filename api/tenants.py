"""Tenants and API keys: create a tenant (random prefix-cache namespace and webhook secret), create and
revoke API keys. Keys are stored as sha256 hashes; the full key is returned once, on creation, and
identified afterwards by its prefix."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from inferq.db import ApiKey, Tenant, utcnow

KEY_SCHEME = "iq"


class TenantError(ValueError):
    """A tenant or key operation that cannot be done (duplicate name, unknown tenant or key)."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> tuple[str, str]:
    """A new API key and its public prefix: ``iq_<8 hex>_<43 url-safe chars>``; the prefix is
    ``iq_<8 hex>``."""
    prefix = f"{KEY_SCHEME}_{secrets.token_hex(4)}"
    return f"{prefix}_{secrets.token_urlsafe(32)}", prefix


@dataclass
class NewKey:
    key: str  # shown once
    prefix: str
    tenant: str
    is_admin: bool


def create_tenant(session_factory: sessionmaker, name: str, *, max_queued_jobs: int | None = None,
                  tokens_per_minute: int | None = None) -> Tenant:
    name = name.strip()
    if not name:
        raise TenantError("tenant name must not be empty")
    with session_factory() as s:
        tenant = Tenant(
            name=name,
            cache_namespace=secrets.token_hex(16),
            webhook_secret=secrets.token_urlsafe(32),
            max_queued_jobs=max_queued_jobs,
            tokens_per_minute=tokens_per_minute,
        )
        s.add(tenant)
        try:
            s.commit()
        except IntegrityError as exc:
            raise TenantError(f"a tenant named {name!r} already exists") from exc
        return tenant


def get_tenant(session: Session, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise TenantError(f"no tenant named {name!r}")
    return tenant


def set_fair_share_weight(session_factory: sessionmaker, name: str, weight: float) -> Tenant:
    """Set the tenant's fair-share weight: its share of its tier's admitted tokens relative to the other busy
    tenants (scheduler/fairness.py). Jobs enqueued from now on carry it (after the API's auth cache expires);
    jobs already queued keep the weight they were enqueued with."""
    if not 0 < weight < float("inf"):
        raise TenantError("the weight must be a positive number")
    with session_factory() as s:
        tenant = get_tenant(s, name)
        tenant.fair_share_weight = weight
        s.commit()
        return tenant


def create_key(session_factory: sessionmaker, tenant_name: str, *, admin: bool = False) -> NewKey:
    with session_factory() as s:
        tenant = get_tenant(s, tenant_name)
        for _ in range(5):  # prefixes are 32 random bits; retry the (unlikely) collision
            key, prefix = generate_key()
            s.add(ApiKey(tenant_id=tenant.id, prefix=prefix, key_hash=hash_key(key), is_admin=admin))
            try:
                s.commit()
            except IntegrityError:
                s.rollback()
                continue
            return NewKey(key=key, prefix=prefix, tenant=tenant.name, is_admin=admin)
    raise TenantError("could not allocate a unique key prefix")  # pragma: no cover


def revoke_key(session_factory: sessionmaker, prefix: str) -> ApiKey:
    """Revoke a key by its prefix (idempotent: revoking twice keeps the first revocation time)."""
    with session_factory() as s:
        key = s.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
        if key is None:
            raise TenantError(f"no API key with prefix {prefix!r}")
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            s.commit()
        return key


def list_keys(session: Session, tenant: Tenant) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.created_at)))
