"""Steps with prompt tokens through the piece graphs (`piece_graphs=True`): the layers'
work between attentions over padded static buffers, the attention on the real rows.
On the CPU nothing is captured and the same pieces run eagerly, so what is checked
here is the cut and the padding: the tokens a user gets are those of the plain pass."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.piece_graphs import BUCKET

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_steps_through_the_pieces_give_the_plain_passs_tokens(model_dir):
    # a prompt chunked over several steps beside short ones decoding, a prefix hit after
    # them: token counts below, at and between buckets, every step padded but one
    long = [(7 * i) % 500 + 1 for i in range(2 * BUCKET + 40)]  # within the vocabulary
    prompts = [long, [5, 6, 7], list(range(40, 140)), [9] * 17]
    hit = long + [3, 4]
    options = dict(device="cpu", max_num_batched_tokens=BUCKET + 1)
    plain = LLM(model_dir("tiny-qwen3"), **options)
    pieces = LLM(model_dir("tiny-qwen3"), piece_graphs=True, **options)
    for prompts_now in (prompts, [hit]):
        want = [o.outputs[0].token_ids for o in plain.generate(prompts_now, PARAMS)]
        got = [o.outputs[0].token_ids for o in pieces.generate(prompts_now, PARAMS)]
        assert got == want
    runner = pieces.engine.runner
    assert runner.pieces.buckets == [BUCKET, 2 * BUCKET]
    assert runner.pieces.replays >= 4  # the chunks of the long prompt and the decodes


def test_a_mixture_of_experts_runs_its_steps_as_before(model_dir):
    llm = LLM(model_dir("tiny-moe"), device="cpu", piece_graphs=True)
    assert llm.engine.runner.pieces is None  # routed experts: not cut into pieces
    out = llm.generate([[1, 2, 3]], PARAMS)
    assert len(out[0].outputs[0].token_ids) == PARAMS.max_tokens
