"""`yinian bench serve` against a scripted OpenAI-compatible server, and its datasets."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from fake_openai_server import ERROR_BODY, FakeOpenAIServer
from paths import ROOT

from bench.loadgen import datasets
from bench.loadgen.cli import run
from bench.loadgen.client import RequestResult
from bench.loadgen.metrics import compute_metrics
from bench.loadgen.serve import arrival_offsets

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def tok_dir(model_dir):
    return model_dir("tiny-llama")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return datasets.load_tokenizer(tok_dir)


def bench(server, tok_dir, tmp_path, *extra, name="run"):
    """Runs `yinian bench serve` quietly; returns (exit code, result JSON of a single run)."""
    argv = [
        "serve", "--base-url", server.url, "--tokenizer", str(tok_dir),
        "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "4",
        "--result-dir", str(tmp_path), "--result-filename", name, "--disable-tqdm",
        *extra,
    ]  # fmt: skip
    rc = run(argv)
    path = tmp_path / f"{name}.json"
    return rc, json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_latency_metrics_match_the_scripted_delays(server, tok_dir, tmp_path, backend):
    # First token 100 ms after the request, then one every 20 ms, 8 tokens.
    server.configure(first_token_s=0.1, interval_s=0.02, num_tokens=8)
    rc, r = bench(server, tok_dir, tmp_path, "--backend", backend, "--no-plots")
    assert rc == 0 and r["completed"] == 4 and r["failed"] == 0
    assert 95 <= r["median_ttft_ms"] <= 170
    assert 17 <= r["median_tpot_ms"] <= 30
    assert 15 <= r["median_itl_ms"] <= 30
    assert 235 <= r["median_e2el_ms"] <= 350  # 100 + 7 * 20
    assert r["output_lens"] == [8] * 4 and r["total_output_tokens"] == 32
    # 7 gaps between 8 content chunks: the chat role-only chunk is not a token.
    assert all(len(itl) == 7 for itl in r["itls"])
    assert r["endpoint"] == (
        "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    )
    body = server.stats.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8 and body["ignore_eos"] is True
    assert ("messages" in body) == (backend == "openai-chat")


def test_without_usage_output_tokens_are_counted_chunks(server, tok_dir, tmp_path):
    server.configure(first_token_s=0.0, interval_s=0.002, num_tokens=5, usage=False)
    rc, r = bench(server, tok_dir, tmp_path, "--no-plots")
    assert rc == 0 and r["output_lens"] == [5] * 4
    assert r["input_lens"] == [16] * 4  # no usage: the dataset's exact prompt length


def test_api_key_is_sent_and_a_rejection_is_a_failure(server, tok_dir, tmp_path):
    server.configure(first_token_s=0.0, interval_s=0.001, num_tokens=2, api_key="sk-good")
    rc, r = bench(server, tok_dir, tmp_path, "--api-key", "sk-good", "--no-plots")
    assert rc == 0 and r["completed"] == 4
    assert set(server.stats.auth_headers) == {"Bearer sk-good"}
    assert "api_key" not in r  # never written to disk
    rc, r = bench(server, tok_dir, tmp_path, "--api-key", "sk-bad", "--no-plots")
    assert rc == 1 and r["failed"] == 4
    assert set(r["status_codes"]) == {401} and "bad api key" in r["errors"][0]


@pytest.mark.parametrize("mode", ["http500", "midstream", "drop"])
def test_a_failing_server_is_reported_as_failures_not_latency(server, tok_dir, tmp_path, mode):
    server.configure(first_token_s=0.0, interval_s=0.002, num_tokens=8, mode=mode)
    rc, r = bench(server, tok_dir, tmp_path, "--no-plots")
    assert rc == 1
    assert r["completed"] == 0 and r["failed"] == 4 and len(r["failures"]) == 4
    assert r["warmup_errors"]  # the warmup request failed the same way
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert r[key] is None  # no samples: null, never a fast 0 ms
    assert r["request_throughput"] == 0 and r["total_output_tokens"] == 0
    if mode == "http500":
        assert r["status_codes"] == [500] * 4
        assert [json.loads(e) for e in r["errors"]] == [ERROR_BODY] * 4  # verbatim
    elif mode == "midstream":
        assert all(json.loads(e) == ERROR_BODY for e in r["errors"])
    else:
        assert all(e and "Error" in e for e in r["errors"])


def test_failures_never_enter_latency_and_goodput_checks_every_slo():
    def ok(ttft, latency, n):
        return RequestResult(success=True, ttft=ttft, latency=latency, output_tokens=n)

    results = [
        ok(0.1, 1.0, 10),  # tpot 100 ms
        ok(0.3, 0.75, 10),  # tpot 50 ms
        ok(0.2, 0.2, 1),  # one token: no TPOT sample, TPOT 0 for goodput
        RequestResult(success=False, latency=0.001, error="boom"),
    ]
    m = compute_metrics(results, 2.0, [50, 99], {"ttft": 250, "tpot": 60})
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_e2el_ms"] == pytest.approx(650.0)
    assert m["mean_tpot_ms"] == pytest.approx(75.0)  # only the two multi-token requests
    assert m["request_goodput"] == pytest.approx(0.5)  # only the third meets both SLOs
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(21 / 2.0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])  # with and without a BOS
@pytest.mark.parametrize("fmt", ["text", "ids"])
def test_random_prompts_have_exactly_the_requested_lengths(model_dir, name, fmt):
    from transformers import AutoTokenizer

    tok = datasets.load_tokenizer(model_dir(name))
    hf = AutoTokenizer.from_pretrained(model_dir(name))  # an independent count
    fixed = datasets.random_requests(tok, 20, 100, 16, seed=1, prompt_format=fmt)
    assert [r.prompt_len for r in fixed] == [100] * 20
    ranged = datasets.random_requests(
        tok, 30, 64, 16, range_ratio=0.5, prefix_len=8, seed=2, prompt_format=fmt
    )
    assert len({r.prompt_len for r in ranged}) > 5
    assert all(8 <= r.output_len <= 24 for r in ranged)
    for reqs in (fixed, ranged):
        assert datasets.check_prompt_lengths(tok, reqs) == []
        for r in reqs:
            if fmt == "text":
                assert len(hf(r.prompt)["input_ids"]) == r.prompt_len
            else:
                assert len(r.prompt) == r.prompt_len
                assert not set(r.prompt[1:]) & tok.special_ids
    if name == "tiny-llama" and fmt == "ids":
        assert fixed[0].prompt[0] == tok.token_to_id("<|begin_of_text|>")  # as the server sees it


def test_prefix_repetition_prompts_share_exact_token_prefixes(tok):
    reqs = datasets.prefix_repetition_requests(tok, 12, 32, 16, num_prefixes=4, output_len=8)
    assert datasets.check_prompt_lengths(tok, reqs) == []
    ids = [tok.encode(r.prompt) for r in reqs]
    assert {len(i) for i in ids} == {1 + 32 + 16}
    groups: dict[tuple, list] = {}
    for i in ids:
        groups.setdefault(tuple(i[:33]), []).append(tuple(i[33:]))
    assert sorted(len(g) for g in groups.values()) == [3, 3, 3, 3]
    assert all(len(set(g)) == 3 for g in groups.values())  # distinct suffixes
    assert [r.prompt for r in reqs] != sorted(r.prompt for r in reqs)  # shuffled


def test_multi_turn_conversations_grow_turn_by_turn(tok):
    reqs = datasets.multi_turn_requests(tok, 3, 3, system_len=32, user_len=8, output_len=8)
    assert [(r.turn, r.conversation_id) for r in reqs] == [
        (t, u) for t in range(3) for u in range(3)
    ]
    assert datasets.check_prompt_lengths(tok, reqs) == []
    system = reqs[0].messages[0]
    for user in range(3):
        conv = [r for r in reqs if r.conversation_id == user]
        for k, r in enumerate(conv):
            assert r.messages[0] == system and len(r.messages) == 2 + 2 * k
            assert [m["role"] for m in r.messages[1:]] == ["user", "assistant"] * k + ["user"]
        for a, b in zip(conv, conv[1:]):  # each prompt extends the previous one
            assert b.prompt.startswith(a.prompt) and b.prompt_len > a.prompt_len
            assert tok.encode(b.prompt)[: a.prompt_len] == tok.encode(a.prompt)
            assert b.messages[: len(a.messages)] == a.messages


def multi_turn(server, tok_dir, tmp_path, users: int, *flags: str):
    """`bench serve` of `users` three-turn conversations (16-token system prompt, 4-token
    user turns and replies)."""
    return bench(
        server, tok_dir, tmp_path, "--dataset-name", "multi-turn", "--num-prompts",
        str(3 * users), "--multi-turn-num-turns", "3", "--multi-turn-system-len", "16",
        "--multi-turn-user-len", "4", "--multi-turn-output-len", "4",
        "--num-warmups", "0", "--no-plots", *flags,
    )  # fmt: skip


def test_multi_turn_waits_for_the_previous_turn(server, tok_dir, tmp_path):
    server.configure(first_token_s=0.03, interval_s=0.005, num_tokens=4)
    rc, r = multi_turn(server, tok_dir, tmp_path, 2, "--backend", "openai-chat")
    assert rc == 0 and r["completed"] == 6 and r["max_concurrent_requests"] == 2
    ends = {}
    for cid, turn, start, e2el in zip(
        r["conversation_ids"], r["turns"], r["start_times"], r["e2els"]
    ):
        if turn > 0:
            assert start >= ends[(cid, turn - 1)]
        ends[(cid, turn)] = start + e2el
    # The chat bodies carry the whole conversation so far.
    assert sorted(len(b["messages"]) for b in server.stats.bodies) == [2, 2, 4, 4, 6, 6]


def test_max_active_conversations_lets_a_user_finish_before_the_next_starts(
    server, tok_dir, tmp_path
):
    server.configure(first_token_s=0.02, interval_s=0.005, num_tokens=4)
    rc, r = multi_turn(server, tok_dir, tmp_path, 3, "--max-active-conversations", "2")
    assert rc == 0 and r["completed"] == 9
    spans = {}
    for cid, start, e2el in zip(r["conversation_ids"], r["start_times"], r["e2els"]):
        first, last = spans.get(cid, (math.inf, 0.0))
        spans[cid] = (min(first, start), max(last, start + e2el))
    # users 0 and 1 at once; user 2 only once one of them has sent its third turn
    assert spans[2][0] >= min(spans[0][1], spans[1][1])
    assert spans[1][0] < spans[0][1]
    assert r["max_concurrent_requests"] == 2


def test_a_rate_paces_turns_in_the_order_they_become_ready(server, tok_dir, tmp_path):
    # One conversation under way at a time, 10 turns a second: a user's second turn takes
    # the schedule's next time once its first is done, not the time of the list's
    # fourth request (every first turn comes before any second in the list).
    server.configure(first_token_s=0.01, interval_s=0.002, num_tokens=4)
    rc, r = multi_turn(
        server, tok_dir, tmp_path, 3, "--max-active-conversations", "1",
        "--request-rate", "10", "--seed", "5",
    )  # fmt: skip
    assert rc == 0 and r["completed"] == 9
    order = np.argsort(r["start_times"])
    sent = [(r["conversation_ids"][i], r["turns"][i]) for i in order]
    assert sent == [(u, t) for u in range(3) for t in range(3)]
    slots = arrival_offsets(9, 10.0, 1.0, seed=5)
    end = 0.0
    for k, i in enumerate(order):  # each send at its slot, or when the turn before ends
        expected = max(slots[k], end)
        assert r["start_times"][i] == pytest.approx(expected, abs=0.03)
        end = r["start_times"][i] + r["e2els"][i]


def test_sharegpt_first_two_turns_and_vllm_filters(tok, tmp_path):
    long = " ".join(["word"] * 1200)
    data = [
        {"conversations": [{"from": "human", "value": "Tell me about the sea, please."},
                           {"from": "gpt", "value": "The sea is large and full of water."}]},
        {"conversations": [{"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "A reply that is long enough to keep."}]},
        {"conversations": [{"from": "human", "value": "A prompt that is long enough."},
                           {"from": "gpt", "value": "No"}]},
        {"conversations": [{"from": "human", "value": long},
                           {"from": "gpt", "value": "Too long a prompt to keep it."}]},
        {"conversations": [{"from": "human", "value": "Only one turn in this entry."}]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = datasets.sharegpt_requests(tok, path, 3)
    assert {r.prompt for r in reqs} == {"Tell me about the sea, please."}  # oversampled
    answer = len(tok.encode("The sea is large and full of water.", add_special_tokens=False))
    assert reqs[0].output_len == answer
    assert datasets.check_prompt_lengths(tok, reqs) == []
    # A fixed output length skips the short-output filter, as in vLLM.
    fixed = datasets.sharegpt_requests(tok, path, 2, output_len=5, prompt_format="ids")
    assert len(fixed) == 2 and {r.output_len for r in fixed} == {5}
    assert all(isinstance(r.prompt, list) for r in fixed)


def test_json_report_is_complete_and_plots_are_written(server, tok_dir, tmp_path):
    server.configure(first_token_s=0.01, interval_s=0.003, num_tokens=6)
    rc, r = bench(
        server, tok_dir, tmp_path, "--goodput", "ttft:1000", "tpot:1000", "--prompt-format", "ids"
    )
    assert rc == 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert isinstance(r[f"{stat}_{name}_ms"], float)
    for key in (
        "date", "model", "base_url", "endpoint", "request_rate", "burstiness", "max_concurrency",
        "seed", "dataset", "num_prompts", "duration", "completed", "failed",
        "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
        "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
        "max_concurrent_requests", "goodput", "failures", "input_lens", "output_lens", "ttfts",
        "itls", "e2els", "start_times", "status_codes", "errors", "plots",
    ):  # fmt: skip
        assert key in r, key
    assert r["model"] == "fake-model"  # from GET /v1/models
    assert r["request_rate"] == "inf" and r["dataset"]["name"] == "random"
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert r["total_input_tokens"] == 4 * 16  # token-id prompts: usage counts the ids
    assert isinstance(server.stats.bodies[-1]["prompt"], list)
    (png,) = r["plots"]
    assert (tmp_path / "run-cdf.png").read_bytes()[:8] == PNG_MAGIC


def test_a_sweep_writes_one_result_per_rate_and_the_sweep_plots(server, tok_dir, tmp_path):
    server.configure(first_token_s=0.005, interval_s=0.002, num_tokens=4)
    rc, _ = bench(server, tok_dir, tmp_path, "--request-rates", "40,inf", "--num-prompts", "6")
    assert rc == 0
    rates = [json.loads((tmp_path / f"run-rate{x}.json").read_text()) for x in ("40", "inf")]
    assert [r["request_rate"] for r in rates] == [40, "inf"]
    assert all(r["completed"] == 6 for r in rates)
    sweep = json.loads((tmp_path / "run-sweep.json").read_text())
    assert [r["request_rate"] for r in sweep["runs"]] == [40, "inf"]
    assert "ttfts" not in sweep["runs"][0]  # the summary leaves per-request arrays out
    for png in ("run-sweep-latency.png", "run-sweep-throughput.png", "run-rate40-cdf.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC


def test_each_rate_of_a_sweep_draws_its_own_arrivals(server, tok_dir, tmp_path):
    server.configure(first_token_s=0.0, interval_s=0.001, num_tokens=2)
    rc, _ = bench(server, tok_dir, tmp_path, "--request-rates", "40,80", "--num-prompts", "12",
                  "--seed", "3", "--num-warmups", "0", "--no-plots")  # fmt: skip
    assert rc == 0
    runs = [json.loads((tmp_path / f"run-rate{x}.json").read_text()) for x in ("40", "80")]
    assert [r["arrival_seed"] for r in runs] == [3, 4]
    # as sent, each on its rate's own schedule, not the first rate's gaps at twice the pace
    for one, rate, seed in zip(runs, (40.0, 80.0), (3, 4)):
        expected = arrival_offsets(12, rate, 1.0, seed=seed)
        assert np.abs(np.asarray(one["start_times"]) - expected).max() < 0.02
    assert not np.allclose(arrival_offsets(12, 40.0, seed=3) / 2, arrival_offsets(12, 80.0, seed=4))


def test_each_rate_of_a_sweep_sends_its_own_prompts_unless_asked_to_repeat(
    server, tok_dir, tmp_path
):
    # a server with a prefix cache would answer a repeated prompt from its cache
    server.configure(first_token_s=0.0, interval_s=0.001, num_tokens=2)
    tok = datasets.load_tokenizer(str(tok_dir))

    def drawn(seed: int) -> list[str]:  # the dataset's prompts for a seed
        return sorted(r.prompt for r in datasets.random_requests(tok, 5, 16, 8, seed=seed))

    assert drawn(0) != drawn(1)
    common = ("--request-rates", "inf,inf", "--num-prompts", "5", "--num-warmups", "0",
              "--no-plots")  # fmt: skip
    for extra, second_seed in (((), 1), (("--sweep-repeat-requests",), 0)):
        before = len(server.stats.bodies)
        rc, _ = bench(server, tok_dir, tmp_path, *common, *extra)
        sent = [b["prompt"] for b in server.stats.bodies[before:]]
        assert rc == 0 and len(sent) == 10
        assert sorted(sent[:5]) == drawn(0) and sorted(sent[5:]) == drawn(second_seed)
    seeds = json.loads((tmp_path / "run-rateinf.json").read_text())["dataset"].get("seeds")
    assert seeds is None  # repeated: one seed, the dataset's


def test_poisson_arrivals_have_mean_gap_one_over_rate():
    offsets = arrival_offsets(4000, rate=50.0, burstiness=1.0, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = np.diff(arrival_offsets(4000, rate=50.0, burstiness=4.0, seed=3))
    assert bursty.mean() == pytest.approx(1 / 50, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(0.5, rel=0.1)  # gamma: CV 1/sqrt(k)
    assert np.array_equal(offsets, arrival_offsets(4000, 50.0, 1.0, seed=3))  # seeded
    assert not arrival_offsets(5, math.inf).any()
    # whatever the draw, the run offers the rate named: n - 1 gaps span (n - 1) / rate
    for seed in range(20):
        few = arrival_offsets(320, rate=24.0, seed=seed)
        assert few[-1] == pytest.approx(319 / 24.0, rel=1e-9)
        assert np.diff(few).min() >= 0 and np.diff(few).std() / np.diff(few).mean() > 0.7


def test_requests_are_sent_on_the_seeded_schedule(server, tok_dir, tmp_path):
    server.configure(first_token_s=0.0, interval_s=0.001, num_tokens=2)
    rc, r = bench(
        server, tok_dir, tmp_path, "--request-rate", "40", "--num-prompts", "30",
        "--seed", "7", "--num-warmups", "0", "--no-plots",
    )  # fmt: skip
    assert rc == 0
    expected = arrival_offsets(30, 40.0, 1.0, seed=7)
    sent = np.asarray(r["start_times"])
    assert np.abs(sent - expected).max() < 0.02
    assert r["offered_rate"] == pytest.approx(40.0, rel=0.05)  # the rate named, as sent
    assert np.diff(sent).mean() == pytest.approx(np.diff(expected).mean(), rel=0.1)


def test_max_concurrency_is_respected(server, tok_dir, tmp_path):
    server.configure(first_token_s=0.02, interval_s=0.005, num_tokens=3)
    rc, r = bench(
        server, tok_dir, tmp_path, "--max-concurrency", "3", "--num-prompts", "12",
        "--num-warmups", "0", "--no-plots",
    )  # fmt: skip
    assert rc == 0 and r["completed"] == 12
    assert server.stats.peak_in_flight == 3
    assert r["max_concurrent_requests"] <= 3


TRACE = ROOT / "bench" / "loadgen" / "data" / "mooncake_small.jsonl"


def test_a_mooncake_trace_shares_blocks_where_its_hash_ids_do(tok):
    reqs = datasets.mooncake_requests(tok, str(TRACE), 40, block_tokens=512)
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()[:40]]
    assert [r.prompt_len for r in reqs] == [row["input_length"] for row in rows]
    assert [r.output_len for r in reqs] == [row["output_length"] for row in rows]
    assert [r.send_at for r in reqs] == [(row["timestamp"] - rows[0]["timestamp"]) / 1e3
                                         for row in rows]  # fmt: skip
    allowed = set(datasets.allowed_token_ids(tok).tolist())
    for a, ra in zip(reqs, rows):
        assert set(a.prompt) <= allowed  # no special token inside a prompt
        for b, rb in zip(reqs, rows):
            for k, (ha, hb) in enumerate(zip(ra["hash_ids"], rb["hash_ids"])):
                block_a, block_b = a.prompt[k * 512 : (k + 1) * 512], b.prompt[k * 512 :][:512]
                n = min(len(block_a), len(block_b), 32)
                if n >= 8:  # a block's first tokens, compared where both have enough
                    assert (block_a[:n] == block_b[:n]) == (ha == hb), (ra, rb, k)


def test_a_trace_is_sent_at_its_own_times(server, tok_dir, tmp_path):
    server.configure(first_token_s=0.0, interval_s=0.001, num_tokens=2)
    rc, r = bench(
        server, tok_dir, tmp_path, "--dataset-name", "mooncake", "--dataset-path", str(TRACE),
        "--prompt-format", "ids", "--num-prompts", "12", "--mooncake-slowdown-factor", "0.1",
        "--num-warmups", "0", "--no-plots",
    )  # fmt: skip
    assert rc == 0 and r["completed"] == 12
    stamps = [json.loads(line)["timestamp"] for line in TRACE.read_text().splitlines()[:12]]
    expected = (np.asarray(stamps) - stamps[0]) / 1e3 * 0.1
    assert np.abs(np.asarray(r["start_times"]) - expected).max() < 0.02
    assert r["dataset"]["name"] == "mooncake" and r["dataset"]["slowdown"] == 0.1


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 2}', "missing hash_ids"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 2, "hash_ids": [1]}',
         "timestamp must be"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 2, "hash_ids": []}',
         "input_length must be"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}',
         "1 hash ids for 600 tokens (2 blocks of 512)"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [true]}',
         "hash_ids must be"),
    ],
)  # fmt: skip
def test_a_bad_trace_line_is_named_and_refused(tok, tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
                    + line + "\n")  # fmt: skip
    with pytest.raises(ValueError, match="line 2") as info:
        datasets.mooncake_requests(tok, str(path), 10)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--request-rate", "4"], "sent at its own times"),
        (["--backend", "openai-chat"], "/v1/completions only"),
        (["--prompt-format", "text"], "use --prompt-format ids"),
    ],
)
def test_a_trace_with_flags_it_cannot_honour_is_refused(server, tok_dir, tmp_path, extra,
                                                         message):  # fmt: skip
    argv = ["--dataset-name", "mooncake", "--dataset-path", str(TRACE), "--num-prompts", "2",
            "--prompt-format", "ids", *extra]  # fmt: skip
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        bench(server, tok_dir, tmp_path, *argv)
