"""Cache-aware routing across workers: the pure part (no Redis, no torch).

Each worker's prefix cache is private, so a tenant's shared system prompt is only reused when its jobs land
on the same worker. At enqueue time a job gets a *routing key* (``routing_key``) and an *owner* among the
live workers (``owner``: rendezvous, i.e. highest-random-weight, hashing); the job goes to the owner's
routed lane, which only the owner reads while it keeps up. ``may_take`` says when any other worker may take
a routed job instead: the owner is gone (its registry heartbeat expired) or the job has waited longer than
a bound (the owner is saturated or slow), so no job is ever stuck behind one worker.

Why rendezvous hashing: with N live workers, a key's owner only changes when that owner leaves or a joining
worker outranks it, so about 1/N of the keys move on a join and only the leaver's keys move on a leave (the
least possible), with no ring or virtual nodes to keep in sync between API processes: each one needs only
the set of live workers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ROUTE_SEPARATOR = ":to:"  # routed lane = the job's usual lane + this + the owner's worker name


@dataclass(frozen=True)
class RoutingConfig:
    """How much of a prompt names its cached prefix (``Settings.cache_routing_prefix_chars`` / ``_tokens``)."""

    prefix_chars: int = 128
    prefix_tokens: int = 32


def prompt_head(request: Mapping[str, Any], config: RoutingConfig) -> bytes | None:
    """The start of the prompt that names its cacheable prefix, as bytes; None when there is no prompt.

    The API does not tokenize at enqueue time (the worker renders chat templates and tokenizes), so the
    engine's block hashes cannot be computed here. What stands in for them:

    * ``prompt_ids``: the first ``prefix_tokens`` ids (a few full blocks of the engine's hash chain);
    * ``prompt``: its first ``prefix_chars`` characters (about ``prefix_chars / 4`` tokens: a few blocks);
    * ``messages``: the first message (the system prompt, typically the shared part), role and content, cut
      to ``prefix_chars``; a chat template only adds fixed text before it, the same for every job.

    Prompts that agree on this head almost surely share their first blocks; prompts that differ in it share
    at most a partial block, which the prefix cache cannot reuse anyway."""
    if request.get("prompt_ids"):
        return json.dumps(list(request["prompt_ids"][: config.prefix_tokens])).encode()
    if isinstance(request.get("prompt"), str):
        return ("p\x00" + request["prompt"][: config.prefix_chars]).encode("utf-8", "surrogatepass")
    messages = request.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], Mapping):
        first = messages[0]
        content = first.get("content")
        text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
        return ("m\x00" + str(first.get("role", "")) + "\x00" + text[: config.prefix_chars]).encode(
            "utf-8", "surrogatepass")
    return None


def routing_key(request: Mapping[str, Any], cache_namespace: str, config: RoutingConfig) -> bytes | None:
    """The job's routing key: the prompt head salted with the tenant's cache namespace (the same salt as the
    engine's block hashes: tenants that share no cache entries share no key). None: route to no one."""
    head = prompt_head(request, config)
    if head is None:
        return None
    return hashlib.blake2b(head, key=cache_namespace.encode()[:64], digest_size=16).digest()


def score(key: bytes, worker: str) -> int:
    """The rendezvous weight of ``worker`` for ``key`` (a 64-bit hash of both)."""
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + worker.encode(), digest_size=8).digest(), "big")


def ranked(key: bytes, workers: Iterable[str]) -> list[str]:
    """The workers in ``key``'s preference order (highest weight first; ties, which need a 64-bit collision,
    by name)."""
    return sorted(set(workers), key=lambda w: (-score(key, w), w))


def owner(key: bytes | None, workers: Iterable[str]) -> str | None:
    """The live worker that owns ``key``: the first of ``ranked``. None when there is no key or no worker."""
    if key is None:
        return None
    order = ranked(key, workers)
    return order[0] if order else None


def assignments(keys: Iterable[bytes], workers: Iterable[str]) -> dict[bytes, str | None]:
    """Each key's owner over the same set of workers (what a join or leave changes: see ``moved``)."""
    live = sorted(set(workers))
    return {k: owner(k, live) for k in keys}


def moved(before: Mapping[bytes, str | None], after: Mapping[bytes, str | None]) -> set[bytes]:
    """The keys whose owner differs between two assignments."""
    return {k for k in before if before[k] != after.get(k)}


def may_take(owner_live: bool, waited_seconds: float, max_wait_seconds: float) -> bool:
    """May a worker other than the owner take a routed job? Yes when the owner is gone, or the job has waited
    at least ``max_wait_seconds`` (the owner is saturated or slow): losing the cached prefix costs one
    prefill, while waiting on a busy owner could cost any amount of time."""
    return not owner_live or waited_seconds >= max_wait_seconds


def routed_lane(lane: str, worker: str) -> str:
    """The stream of ``worker``'s routed jobs of a lane (a tier's stream, or a tenant's lane of it)."""
    return f"{lane}{ROUTE_SEPARATOR}{worker}"
