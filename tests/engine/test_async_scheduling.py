"""Async scheduling: each step is queued before the previous one is read back,
its sequences' input tokens taken from the previous step's samples on the
device. Whatever a request asks for, its output is the same as with plain
stepping, and nothing is left behind."""

from __future__ import annotations

import pytest
from prompts import random_prompts

from basis.structured_output import StructuredOutput
from engine import LLM, SamplingParams
from engine.sampler import PendingSample

CHOICE = StructuredOutput.json_schema(
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                    "ok": {"type": "boolean"}},
     "required": ["n", "ok"], "additionalProperties": False}
)  # fmt: skip


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("tiny-qwen3")


def _engines(folder, **options):
    return [
        LLM(folder, dtype="float32", device="cpu", async_scheduling=mode, **options)
        for mode in (False, True)
    ]


def _workload(sync: LLM):
    """Every kind of request at once; the stop token and string are ones the model
    really produces, so those requests end early."""
    prompts = random_prompts(512, (30, 7, 90, 15, 44, 3, 60, 21, 12, 33), seed=41)
    free = sync.generate(prompts[:2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stop_token = free[0].outputs[0].token_ids[5]
    stop_text = free[1].outputs[0].text[4:7]
    params = [
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=20, temperature=0, stop=[stop_text], ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=18, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, min_tokens=16, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.7, seed=3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=22, temperature=0, frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, top_k=20, min_p=0.05, seed=11),
        SamplingParams(max_tokens=30, temperature=0, structured_output=CHOICE),
        SamplingParams(max_tokens=30, temperature=0.9, seed=5, structured_output=CHOICE),
    ]
    prompts += random_prompts(512, (26, 8), seed=44)
    return prompts, params


def _recorded(llm: LLM, monkeypatch, read: str) -> list[str]:
    """The order of `llm`'s steps queued ("queue") and samples read back ("read", by
    PendingSample's method `read`)."""
    order = []
    real_read, real_launch = getattr(PendingSample, read), llm.engine.runner.launch

    def reading(self):
        order.append("read")
        return real_read(self)

    def launch(*args, **kwargs):
        order.append("queue")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(PendingSample, read, reading)
    llm.engine.runner.launch = launch
    return order


def _summary(out):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs]


def test_every_kind_of_request_matches_plain_stepping(folder):
    sync, fast = _engines(folder)
    prompts, params = _workload(sync)
    expected = [_summary(o) for o in sync.generate(prompts, params)]
    got = [_summary(o) for o in fast.generate(prompts, params)]
    assert got == expected
    assert expected[0][0][2] == "stop" and expected[1][0][2] == "stop"  # ended early
    assert fast.get_stats()["kv_blocks_used"] == 0
    assert not fast.engine.has_work()


def test_steps_really_overlap(folder, monkeypatch):
    """With async scheduling the next step is queued before the last one is read
    back; a stop costs at most one extra token per sequence."""
    sync, fast = _engines(folder)
    order = _recorded(fast, monkeypatch, "result")
    prompts = random_prompts(512, (10, 25, 40, 5), seed=42)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in sync.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == free
    stop = free[0][3]  # ends the first request after 4 tokens
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])
    processed = [llm.get_stats()["num_tokens_processed"] for llm in (sync, fast)]
    expected = [o.outputs[0].token_ids for o in sync.generate(prompts, params)]
    order.clear()
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    assert got == expected and len(got[0]) == 4
    # Prefill, then decode steps each queued ahead of the read-back of the one before.
    assert order[:4] == ["queue", "queue", "read", "queue"]
    assert order.count("read") == order.count("queue")
    stopped_early = sum(len(t) < 12 for t in expected)
    sync_tokens = sync.get_stats()["num_tokens_processed"] - processed[0]
    extra = fast.get_stats()["num_tokens_processed"] - processed[1] - sync_tokens
    assert 0 <= extra <= stopped_early


def test_constrained_steps_are_queued_ahead_too(folder, monkeypatch):
    """A grammar's next mask needs the last token on the host: the next step is still
    queued first, and its mask reads that one token back; outputs as plain stepping."""
    sync, fast = _engines(folder)
    order = _recorded(fast, monkeypatch, "token_ids")
    prompts = random_prompts(512, (10, 25, 40, 5), seed=45)
    params = SamplingParams(max_tokens=30, temperature=0, structured_output=CHOICE)
    expected = [o.outputs[0] for o in sync.generate(prompts, params)]
    order.clear()
    got = [o.outputs[0] for o in fast.generate(prompts, params)]
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in expected
    ]
    assert all(o.finish_reason == "stop" and '"ok"' in o.text for o in got)
    steps = order.count("queue")
    assert steps > 5 and order[:4] == ["queue", "queue", "read", "read"]
    # every decode step's mask read the step before it while that step was queued
    queued_ahead = sum(a == "queue" and b == "read" for a, b in zip(order, order[1:]))
    assert queued_ahead >= steps - 2
    assert fast.get_stats()["kv_blocks_used"] == 0


def test_constrained_masks_are_filled_beside_the_engine(folder, monkeypatch):
    """Once a constrained step runs ahead, the next step's masks are filled on the mask
    thread while the engine applies the step before; the draw is queued before the
    step after it is."""
    import threading

    from engine import grammar

    sync, fast = _engines(folder)
    threads, real_fill = [], grammar.MaskJob._fill

    def fill(job):
        threads.append(threading.current_thread().name)
        return real_fill(job)

    monkeypatch.setattr(grammar.MaskJob, "_fill", fill)
    prompts = random_prompts(512, (10, 25, 40), seed=46)
    params = SamplingParams(max_tokens=30, temperature=0, structured_output=CHOICE)
    expected = [o.outputs[0].token_ids for o in sync.generate(prompts, params)]
    threads.clear()
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == expected
    beside = sum(name.startswith("grammar-masks") for name in threads)
    assert beside >= len(threads) - 2 and beside > 5  # all but the first step's


def test_a_failed_mask_fails_its_requests_and_the_engine_serves_on(folder, monkeypatch):
    from engine import grammar

    _, fast = _engines(folder)
    real_fill, calls = grammar.MaskJob._fill, []

    def fill(job):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("mask fill broke")
        return real_fill(job)

    monkeypatch.setattr(grammar.MaskJob, "_fill", fill)
    prompts = random_prompts(512, (10, 25), seed=47)
    params = SamplingParams(max_tokens=30, temperature=0, structured_output=CHOICE)
    failed = fast.generate(prompts, params)
    assert [o.outputs[0].finish_reason for o in failed] == ["error", "error"]
    assert all("mask fill broke" in (o.error or "") for o in failed)
    again = fast.generate(prompts, params)
    assert all(o.outputs[0].finish_reason == "stop" for o in again)
    assert fast.get_stats()["kv_blocks_used"] == 0


def test_abort_while_a_step_is_queued(folder):
    sync, fast = _engines(folder)
    prompts = random_prompts(512, (20, 35), seed=43)
    params = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)
    expected = sync.generate(prompts[1:], params)[0].outputs[0].token_ids
    engine = fast.engine
    engine.add_request("a", prompts[0], params)
    engine.add_request("b", prompts[1], params)
    outputs = {}
    for _ in range(4):
        for out in engine.step():
            outputs[out.request_id] = out
    assert engine.stepper.inflight is not None  # a step of both requests is queued
    aborted = engine.abort_request("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] = out
            assert out.request_id != "a"
    assert outputs["b"].finished and outputs["b"].outputs[0].token_ids == expected
    assert fast.get_stats()["kv_blocks_used"] == 0


def test_context_limit_gives_the_same_last_token(folder):
    """A request without max_tokens runs to the model's context length: async
    scheduling must not end it one token early because a token is pending."""
    sync, fast = _engines(folder, max_model_len=32)
    prompts = [list(range(5, 25)), list(range(40, 49))]
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    expected = [o.outputs[0] for o in sync.generate(prompts, params)]
    got = [o.outputs[0] for o in fast.generate(prompts, params)]
    assert [len(o.token_ids) for o in expected] == [12, 23]
    assert [(o.token_ids, o.finish_reason) for o in got] == [
        (o.token_ids, o.finish_reason) for o in expected
    ]


def test_a_reused_request_id_gets_no_output_of_the_aborted_one(folder):
    """Abort a request while its step is queued and add a new one under the same id
    (what a decode worker's fallback does): the old step's token must not reach it."""
    sync, fast = _engines(folder)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    second = random_prompts(512, (9,), seed=45)[0]
    expected = sync.generate([second], params)[0].outputs[0].token_ids
    engine = fast.engine
    engine.add_request("r", random_prompts(512, (30,), seed=44)[0], params)
    for _ in range(3):
        engine.step()
    assert engine.stepper.inflight is not None
    engine.abort_request("r")
    engine.add_request("r", second, params)
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outputs)  # nothing stale, empty
