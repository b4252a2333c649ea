"""bench/latency.py's pure parts: the service's TTFT against offline, paired chat by chat."""

from __future__ import annotations

import pytest

from bench.latency import paired_ttft_difference


def test_the_ttft_difference_pairs_each_chat_with_its_offline_pass():
    # chats of very different prefills: a difference of the sides' medians would be chat 2's against chat 1's
    offline = [{"ttft_by_chat_ms": [100.0, 300.0, 200.0]}, {"ttft_by_chat_ms": [110.0, 290.0, 205.0]}]
    service = [{"ttft_by_chat_ms": [108.0, 309.0, 207.0]}, {"ttft_by_chat_ms": [121.0, None, 211.0]}]
    # pairs: 8, 9, 7, 11, (chat 2 of pass 2 got no text: left out), 6 -> median of [6, 7, 8, 9, 11]
    assert paired_ttft_difference(offline, service) == 8.0
    assert paired_ttft_difference([{"ttft_by_chat_ms": [1.0]}], [{"ttft_by_chat_ms": [None]}]) is None
    with pytest.raises(ValueError):  # passes or chats that do not pair up are a bug, not a result
        paired_ttft_difference(offline, service[:1])


def test_the_served_row_is_its_median_pass():
    from bench.latency import median_share

    passes = [{"achieved_gbs": g, "read_alt_gbs": r, "tag": t} for g, r, t in
              ((20.0, 40.0, "a"), (10.0, 40.0, "stalled"), (30.0, 40.0, "c"), (12.0, None, "old"))]
    row = median_share(passes[:3], 30.0)
    assert row["tag"] == "a" and row["pass_shares"] == [0.5, 0.25, 0.75]
    assert median_share(passes[3:], 30.0)["pass_shares"] == [0.4]  # no reads alongside: the read before
