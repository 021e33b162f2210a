"""Structured outputs and logit bias in the engine: even a random-weight model's
output matches its JSON schema, regex, choice or grammar — sampled, with n > 1,
async scheduling, preemption and a resumed request — and a bias of +100 makes
greedy decoding pick that token."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from basis.structured_output import StructuredOutput
from engine import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                 "maxItems": 3},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                  "maximum": 120}, "ok": {"type": "boolean"}}, "required": ["age", "ok"],
                  "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}  # fmt: skip
MAX_TOKENS = 100  # the longest such object, one token per character, fits


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir("tiny-llama"), device="cpu", num_gpu_blocks=64)


def _valid(texts: list[str]) -> None:
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_holds_for_every_sampled_output(llm):
    params = SamplingParams(
        n=3,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        structured_output=StructuredOutput.json_schema(SCHEMA),
    )
    outs = llm.generate([f"prompt {i}" for i in range(8)], params)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 24
    _valid(texts)
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    assert len(set(texts)) > 1  # sampled, not one forced answer


def test_regex_choice_and_grammar(llm):
    cases = {
        StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"): re.compile(r"[0-9]{3}-[a-z]{2}"),
        StructuredOutput.choice(["yes", "no", "maybe"]): re.compile(r"yes|no|maybe"),
        StructuredOutput("grammar", 'root ::= "(" [a-c]+ ")"'): re.compile(r"\([a-c]+\)"),
    }
    for spec, pattern in cases.items():
        outs = llm.generate(["a", "b"], SamplingParams(n=2, max_tokens=40, structured_output=spec))
        for c in (c for o in outs for c in o.outputs):
            assert pattern.fullmatch(c.text), (spec.kind, c.text)


def test_logit_bias_plus_100_makes_greedy_pick_that_token(llm):
    plain = llm.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    token = next(t for t in range(300, 400) if t not in plain[0].outputs[0].token_ids)
    biased = llm.generate(
        ["Hello"],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={token: 100}),
    )
    assert biased[0].outputs[0].token_ids == [token] * 6
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["Hello"], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})


def test_invalid_specification_is_rejected_before_anything_runs(llm):
    engine = llm.engine
    free = engine.kv.pool.num_free_blocks
    for spec in (
        StructuredOutput.json_schema({"type": "nonsense"}),
        StructuredOutput("regex", "[a-"),
        StructuredOutput("grammar", "root ::= ("),
    ):
        with pytest.raises(ValueError, match="structured output"):
            llm.generate(["x"], SamplingParams(structured_output=spec))
    assert not engine.requests and engine.kv.pool.num_free_blocks == free


def test_async_scheduling_preemption_and_resume(model_dir):
    # async scheduling with constrained and free sequences in one batch, and a KV
    # cache so small that sequences are preempted and recomputed mid-output
    llm = LLM(model_dir("tiny-llama"), device="cpu", async_scheduling=True, num_gpu_blocks=14)
    spec = StructuredOutput.json_schema(SCHEMA)
    constrained = SamplingParams(max_tokens=MAX_TOKENS, seed=7, structured_output=spec)
    free = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)
    outs = llm.generate([f"p{i}" for i in range(6)], [constrained, free] * 3)
    assert llm.engine.scheduler.num_preemptions > 0
    _valid([outs[i].outputs[0].text for i in (0, 2, 4)])
    assert all(len(outs[i].outputs[0].token_ids) == MAX_TOKENS for i in (1, 3, 5))
    # a migrated request resumes after the tokens it already streamed
    tokens = outs[0].outputs[0].token_ids
    half = tokens[: len(tokens) // 2]
    prompt = llm.engine.tokenize("p0") + half
    rest = llm.generate(
        [prompt], SamplingParams(max_tokens=MAX_TOKENS, structured_output=spec.after(half))
    )[0].outputs[0]
    text = llm.engine.tokenizer.decode(half + rest.token_ids)
    _valid([text])


def test_a_steps_masks_filled_together_equal_each_filled_alone(llm):
    """The batched fill (llguidance's executor, all rows in one call) gives each row
    exactly the mask its grammar gives alone, for grammars at different positions."""
    import random

    import numpy as np

    from engine.grammar import MaskJob

    compiler = llm.engine.grammars
    specs = [
        StructuredOutput.json_schema(SCHEMA),
        StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"),
        StructuredOutput.choice(["yes", "no", "maybe"]),
        StructuredOutput.json_object(),
    ]
    rng, grammars = random.Random(0), []
    for i in range(9):
        grammar = compiler.start(specs[i % len(specs)])
        for _ in range(i % 4):  # a few allowed tokens in: each row at its own position
            row = np.empty(grammar.words, dtype=np.int32)
            grammar.fill(row)
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")
            allowed = [t for t in np.flatnonzero(bits) if t < compiler.vocab_size]
            if grammar.terminated or not allowed:
                break
            assert grammar.accept(int(rng.choice(allowed)))
        grammars.append(grammar)
    together = MaskJob(list(range(len(grammars))), grammars).result()
    for row, grammar in zip(together, grammars):
        alone = np.empty(grammar.words, dtype=np.int32)
        grammar.fill(alone)
        assert np.array_equal(row, alone)
