"""Cache-aware routing, the pure part (inferq/routing.py): key derivation, the rendezvous owner (stable,
spread, minimal movement when a worker joins or leaves) and the fallback rule."""

from __future__ import annotations

from collections import Counter

from inferq import routing

CFG = routing.RoutingConfig(prefix_chars=32, prefix_tokens=8)
WORKERS = [f"w{i}" for i in range(4)]
KEYS = [routing.routing_key({"prompt": f"system prompt number {i:05d}" + "x" * 40}, "ns", CFG) for i in range(2000)]


def test_jobs_sharing_a_prefix_share_a_key_and_tenants_do_not():
    a = routing.routing_key({"prompt": "S" * 40 + "question one"}, "tenant-a", CFG)
    b = routing.routing_key({"prompt": "S" * 40 + "another question"}, "tenant-a", CFG)
    other = routing.routing_key({"prompt": "S" * 40 + "question one"}, "tenant-b", CFG)
    assert a == b and a != other
    assert routing.routing_key({"prompt": "T" + "S" * 40}, "tenant-a", CFG) != a


def test_key_of_token_ids_and_of_chats():
    ids = list(range(100))
    assert routing.routing_key({"prompt_ids": ids}, "n", CFG) == routing.routing_key({"prompt_ids": ids[:8] + [7]}, "n", CFG)
    assert routing.routing_key({"prompt_ids": ids}, "n", CFG) != routing.routing_key({"prompt_ids": ids[1:]}, "n", CFG)
    sys_msg = {"role": "system", "content": "You are terse."}
    chat1 = {"messages": [sys_msg, {"role": "user", "content": "hi"}]}
    chat2 = {"messages": [sys_msg, {"role": "user", "content": "bye"}]}
    assert routing.routing_key(chat1, "n", CFG) == routing.routing_key(chat2, "n", CFG)
    user_first = {"messages": [{"role": "user", "content": "You are terse."}]}
    assert routing.routing_key(user_first, "n", CFG) != routing.routing_key(chat1, "n", CFG)
    assert routing.routing_key({"max_tokens": 3}, "n", CFG) is None


def test_owner_is_stable_and_independent_of_order():
    for key in KEYS[:50]:
        first = routing.owner(key, WORKERS)
        assert first in WORKERS
        assert routing.owner(key, list(reversed(WORKERS))) == first
        assert routing.owner(key, WORKERS + [first]) == first  # duplicates do not matter
    assert routing.owner(None, WORKERS) is None and routing.owner(KEYS[0], []) is None


def test_keys_spread_evenly():
    counts = Counter(routing.assignments(KEYS, WORKERS).values())
    assert set(counts) == set(WORKERS)
    assert min(counts.values()) > len(KEYS) / len(WORKERS) * 0.8, counts


def test_a_leave_moves_only_the_leavers_keys():
    before = routing.assignments(KEYS, WORKERS)
    after = routing.assignments(KEYS, [w for w in WORKERS if w != "w2"])
    moved = routing.moved(before, after)
    assert moved == {k for k, w in before.items() if w == "w2"}
    assert all(after[k] != "w2" for k in KEYS)


def test_a_join_moves_about_one_in_n_keys_all_to_the_newcomer():
    before = routing.assignments(KEYS, WORKERS)
    after = routing.assignments(KEYS, [*WORKERS, "w4"])
    moved = routing.moved(before, after)
    assert all(after[k] == "w4" for k in moved)
    assert 0.8 / 5 < len(moved) / len(KEYS) < 1.2 / 5, len(moved)
    # the newcomer leaving again restores the old assignment exactly
    assert routing.assignments(KEYS, WORKERS) == before


def test_fallback_rule():
    assert not routing.may_take(owner_live=True, waited_seconds=0.1, max_wait_seconds=0.5)
    assert routing.may_take(owner_live=True, waited_seconds=0.5, max_wait_seconds=0.5)
    assert routing.may_take(owner_live=False, waited_seconds=0.0, max_wait_seconds=0.5)


def test_routed_lane_names_the_owner():
    assert routing.routed_lane("p:jobs:m:batch:tenant:t", "w1") == "p:jobs:m:batch:tenant:t:to:w1"


class _Registry:
    """Stands in for Redis's ``model-workers`` sorted set (what ``routes.live_workers`` reads)."""

    def __init__(self, *workers: str) -> None:
        self.workers = [w.encode() for w in workers]

    def zrangebyscore(self, key, low, high):
        return self.workers


def test_enqueue_routes_only_with_two_live_workers_and_routing_on():
    from inferq.jobs import routes
    from inferq.settings import Settings

    on, off = Settings(cache_routing=True), Settings(cache_routing=False)
    request = {"prompt": "a shared system prompt " * 10}
    two, one, none = _Registry("w1", "w2"), _Registry("w1"), _Registry()
    owner = routes.choose_owner(two, on, "m", request, "ns")
    assert owner == routing.owner(routing.routing_key(request, "ns", routes.config_of(on)), ["w1", "w2"])
    assert routes.choose_owner(two, off, "m", request, "ns") is None  # routing off: the shared lanes
    assert routes.choose_owner(one, on, "m", request, "ns") is None  # one worker: nothing to choose
    assert routes.choose_owner(none, on, "m", request, "ns") is None
    assert routes.choose_owner(two, on, "m", {"max_tokens": 1}, "ns") is None  # no prompt, no key
