"""Prompt-lookup (n-gram) proposals for speculative decoding: no draft model, only the request's own tokens.

When the last ``n`` tokens of a sequence occurred earlier in its prompt or output, the tokens that followed
them there are a cheap guess of what comes next; answers that quote, summarise or edit their prompt repeat
long spans, and the target model verifies a whole guess in one step. ``n`` runs from ``max_n`` down to
``min_n`` (longest context first, as in prompt-lookup decoding); the most recent earlier occurrence wins.

Each request keeps an index ``n-gram -> position after its latest occurrence``, extended by the tokens added
since the last call, so a proposal costs a few dictionary lookups however long the sequence is (a scan of
every position per step would cost O(length) in Python; the issue asks for well under a millisecond per
step at 64 sequences). Pure Python, no torch: the worker's engine calls it between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request


@dataclass(slots=True)
class _Index:
    """One request's n-grams. ``done``: tokens whose n-grams ending there are indexed (the last token of the
    sequence never is: its continuation is what we are guessing)."""

    where: dict[tuple[int, ...], int] = field(default_factory=dict)
    done: int = 0


class NgramProposer:
    """``propose(request, k)``: up to ``k`` tokens that followed the latest earlier occurrence of the
    request's last ``n`` tokens (``max_n >= n >= min_n``), or ``[]``."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, req: Request, k: int) -> list[int]:
        if k < 1:
            return []
        tokens = req.all_token_ids
        index = self._indexes.setdefault(req.request_id, _Index())
        if index.done > len(tokens) - 1:  # should not happen (tokens only grow); rebuild to stay correct
            index = self._indexes[req.request_id] = _Index()
        self._extend(index, tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = index.where.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []

    def forget(self, request_id: str) -> None:
        """Drop a finished request's index."""
        self._indexes.pop(request_id, None)

    def _extend(self, index: _Index, tokens: list[int]) -> None:
        """Index the n-grams ending at every position before the last one not indexed yet."""
        where = index.where
        for end in range(index.done, len(tokens) - 1):  # n-grams tokens[end-n+1 : end+1], followed by end+1
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                where[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        index.done = max(index.done, len(tokens) - 1)
