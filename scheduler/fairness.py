"""Fair sharing of a tier between tenants: deficit round robin (DRR) over tenants, counted in tokens.

Why: admitting a tier's waiting requests in arrival order lets one tenant that queues hundreds of requests
delay every other tenant of the tier behind all of them. DRR keeps the tenants that have waiting requests in a
ring; a tenant's turn adds ``weight * quantum`` tokens to its deficit, and its requests are admitted (its own
priority order, FIFO within a priority) while their cost fits the deficit; then the next tenant's turn comes.
Busy tenants are thus admitted tokens in proportion to their weights, whatever the number of requests each
queues, and a newcomer waits for at most one round, not for a backlog.

Why tokens and not requests: a tenant of long prompts or long outputs would otherwise take more than its share
of the step budget and the KV cache. A request costs ``prompt + max_tokens`` (capped by the context): all it
may compute, known at admission; a request that stops early is not refunded, which keeps the rule simple and
makes an inflated ``max_tokens`` cost its tenant. A tenant whose queue empties loses its deficit (no banking
of credit while idle), as in classic DRR.

Cost: picking the next request is O(1) amortised, and O(tenants) when no tenant can afford its head request
(rounds nobody could use are skipped at once); it never scans the waiting requests.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterator

from scheduler.request import Request


def admission_cost(req: Request) -> int:
    """Tokens charged to the tenant when ``req`` is admitted: its prompt plus its ``max_tokens`` (capped)."""
    return req.max_total_tokens


class FairQueue:
    """The waiting requests of one tier, handed out in DRR order over tenants (``peek`` / ``pop``).

    With ``fair=False`` every request shares one queue: priority (higher first), then arrival, the order
    the scheduler used before fair sharing. ``quantum`` is the base tokens per turn (times the weight)."""

    def __init__(self, quantum: int, fair: bool = True) -> None:
        self.quantum = max(1, quantum)
        self.fair = fair
        self._queues: dict[str, list[Request]] = {}  # per tenant: priority (higher first), FIFO within one
        self._ring: deque[str] = deque()  # tenants with waiting requests; the head's turn is on
        self._deficit: dict[str, float] = {}  # tokens a tenant may still be admitted this turn
        self._weight: dict[str, float] = {}  # the weight its latest request carried
        self._granted = False  # the head tenant got its quantum for the current turn
        self._len = 0

    # --- membership ----------------------------------------------------------------------------------------
    def _key(self, req: Request) -> str:
        return req.tenant if self.fair else ""

    def add(self, req: Request, front: bool = False) -> None:
        """Queue ``req`` after its tenant's requests of equal priority, or before them with ``front`` (a
        preempted request goes back to the front of its priority group)."""
        key = self._key(req)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = []
            self._ring.append(key)
            self._deficit[key] = 0.0
        self._weight[key] = req.weight
        find = bisect.bisect_left if front else bisect.bisect_right
        queue.insert(find(queue, -req.priority, key=lambda r: -r.priority), req)
        self._len += 1

    def remove(self, req: Request) -> None:
        """Take ``req`` out (aborted, expired); ValueError when it is not queued here."""
        queue = self._queues.get(self._key(req))
        if queue is None:
            raise ValueError(f"request {req.request_id!r} is not waiting")
        queue.remove(req)
        self._len -= 1
        if not queue:
            self._drop(self._key(req))

    def pop(self, req: Request) -> None:
        """``req`` (normally what ``peek`` returned) is admitted: charge its cost to its tenant, dequeue it."""
        self._deficit[self._key(req)] = self._deficit.get(self._key(req), 0.0) - admission_cost(req)
        self.remove(req)

    def _drop(self, key: str) -> None:
        """A tenant without waiting requests leaves the ring and loses its deficit."""
        del self._queues[key], self._deficit[key], self._weight[key]
        if self._ring[0] == key:
            self._granted = False
        self._ring.remove(key)

    # --- order -----------------------------------------------------------------------------------------------
    def peek(self) -> Request | None:
        """The request to admit next (None when empty). Calling it again without a ``pop`` returns the same one,
        so the scheduler may look at it, find it does not fit yet, and come back next step."""
        if not self._ring:
            return None
        if not self.fair:
            return self._queues[self._ring[0]][0]
        misses = 0
        while True:
            key = self._ring[0]
            head = self._queues[key][0]
            if not self._granted:  # the tenant's turn starts
                self._deficit[key] += self._quantum(key)
                self._granted = True
            if self._deficit[key] >= admission_cost(head):
                return head
            self._ring.rotate(-1)  # its turn is over; the deficit is kept for its next one
            self._granted = False
            misses += 1
            if misses == len(self._ring):
                self._skip_idle_rounds()
                misses = 0

    def _quantum(self, key: str) -> float:
        return self._weight[key] * self.quantum

    def _skip_idle_rounds(self) -> None:
        """A whole round passed and no tenant could afford its head request: give every tenant at once the
        quanta of the further rounds in which none could either (what turning the ring would do, in
        O(tenants))."""
        rounds = min(math.ceil((admission_cost(self._queues[k][0]) - self._deficit[k]) / self._quantum(k))
                     for k in self._ring)
        for key in self._ring:
            self._deficit[key] += max(0, rounds - 1) * self._quantum(key)

    # --- read-only views (capacity, metrics, tests) ------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, tenant by tenant (each in its own order): not the admission order."""
        for key in list(self._ring):
            yield from self._queues[key]

    def __getitem__(self, index: int | slice) -> Request | list[Request]:
        return list(self)[index]

    def tenants(self) -> list[str]:
        """Tenants with waiting requests, in turn order (the head's turn is on)."""
        return list(self._ring)

    def head(self, tenant: str) -> Request:
        """The request ``tenant`` would be admitted next (its priority order, FIFO within one)."""
        return self._queues[tenant][0]

    def weight(self, tenant: str) -> float:
        return self._weight[tenant]
