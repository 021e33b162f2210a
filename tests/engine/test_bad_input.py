"""Bad input is a ValueError before any state changes; the engine then still
serves a valid request."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

BAD_PARAMS = [
    dict(max_tokens=0),
    dict(max_tokens=-3),
    dict(temperature=-0.1),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(n=0),
    dict(top_k=-2),
    dict(min_p=2.0),
    dict(temperature=float("nan")),
    dict(max_tokens="7"),
    dict(logprobs=-1),
]


@pytest.mark.parametrize(
    "kwargs", BAD_PARAMS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items())
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir("tiny-llama"), dtype="float32", device="cpu")


BAD_PROMPTS = {
    "empty text": "",
    "empty ids": [],
    "over context": [5] * 4096,
    "id past vocab": [1, 2, 512],
    "negative id": [1, -1],
    "non-int id": [1, 2.5],
}


@pytest.mark.parametrize("name", BAD_PROMPTS)
def test_bad_prompt_rejected_and_engine_keeps_serving(llm, name):
    engine = llm.engine
    before = (len(engine.requests), engine.kv.pool.num_free_blocks)
    with pytest.raises(ValueError) as info:
        llm.generate([[1, 2, 3], BAD_PROMPTS[name]], SamplingParams(max_tokens=2))
    assert str(info.value)
    # Nothing was queued, not even the valid prompt next to the bad one.
    assert (len(engine.requests), engine.kv.pool.num_free_blocks) == before
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_bad_request_next_to_running_ones(llm):
    engine = llm.engine
    engine.add_request("ok-1", [1, 2, 3, 4], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok-1", [1], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [10**6], SamplingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert len(done["ok-1"].outputs[0].token_ids) == 8 and "bad" not in done


def test_request_larger_than_the_cache_is_rejected(model_dir):
    small = LLM(model_dir("tiny-llama"), dtype="float32", device="cpu", num_gpu_blocks=5)
    with pytest.raises(ValueError, match="KV cache"):
        small.generate([[1] * 60], SamplingParams(max_tokens=10))
    assert small.generate([[1] * 20], SamplingParams(max_tokens=10))[0].finished


def test_abort_frees_everything(llm):
    engine = llm.engine
    engine.add_request("long", [1, 2, 3] * 30, SamplingParams(n=2, max_tokens=50))
    engine.step()
    engine.step()
    out = engine.abort_request("long")
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    assert engine.get_stats()["kv_blocks_used"] == 0
    assert not engine.has_unfinished_requests()


def test_a_request_is_checked_once_and_again_when_changed(llm):
    """`validate` marks a request; the engine takes a marked one as it is, and a
    copy with other ids or parameters (`replace`) is checked afresh."""
    engine = llm.engine
    checked = engine.validate(engine.make_request("once", [1, 2, 3], SamplingParams(max_tokens=2)))
    assert checked.validated and engine.validate(checked) is checked
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add(checked.replace(request_id="changed", prompt_ids=[10**6]))
    with pytest.raises(ValueError):
        engine.reserve_remote(checked.replace(request_id="changed", params=SamplingParams(n=2)))
    assert "changed" not in engine.requests
    engine.add(checked)
    while engine.has_unfinished_requests():
        engine.step()
