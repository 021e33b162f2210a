"""The ideal prefix reuse that `yinian bench serve` reports beside the server's
cached tokens: only blocks of requests whose prompt was computed before this
one was sent, in whole blocks, never the last prompt token."""

from __future__ import annotations

from bench.loadgen.prefix_reuse import ideal_cached_tokens


def test_only_what_was_computed_before_counts():
    a = list(range(1, 41))  # 40 tokens: 2 full blocks of 16
    b = a[:32] + [99] * 10  # shares a's 2 blocks
    c = list(a)  # the same prompt as a
    d = a[:32]  # 32 tokens: its second block holds its last token, so at most 16
    prompts = [a, b, c, d]
    sent = [0.0, 2.0, 0.5, 3.0]
    prefilled = [1.0, 2.5, 1.5, None]  # c was sent before a had its first token
    assert ideal_cached_tokens(prompts, sent, prefilled, 16) == [0, 32, 0, 16]


def test_failed_requests_computed_nothing():
    a = list(range(1, 41))
    assert ideal_cached_tokens([a, a], [0.0, 5.0], [None, 6.0], 16) == [0, 0]
