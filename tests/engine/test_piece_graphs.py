"""Steps with prompt tokens through the piece graphs (`piece_graphs=True`): the layers'
work between attentions over padded static buffers, the attention on the real rows.
On the CPU nothing is captured and the same pieces run eagerly, so what is checked
here is the cut and the padding: the tokens a user gets are those of the plain pass."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams, piece_graphs
from engine.piece_graphs import BUCKET
from engine.step_inputs import decodes_first

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
    assert runner.pieces.buckets == [16, 32, 64, 128, BUCKET, 2 * BUCKET]
    assert runner.pieces.replays >= 4  # the chunks of the long prompt and the decodes
    assert plain.engine.runner.pieces is None  # by default only CUDA runs them


def test_the_pieces_are_on_by_default_on_cuda_and_only_when_asked_elsewhere():
    from engine.config import EngineConfig

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    default, on, off = (
        EngineConfig(),
        EngineConfig(piece_graphs=True),
        EngineConfig(piece_graphs=False),
    )
    assert piece_graphs.wanted(default, cuda) and not piece_graphs.wanted(default, cpu)
    assert piece_graphs.wanted(on, cpu) and not piece_graphs.wanted(off, cuda)
    assert not piece_graphs.wanted(EngineConfig(enforce_eager=True), cuda)


def test_a_mixture_of_experts_runs_its_steps_as_before(model_dir):
    llm = LLM(model_dir("tiny-moe"), device="cpu", piece_graphs=True)
    assert llm.engine.runner.pieces is None  # routed experts: not cut into pieces
    out = llm.generate([[1, 2, 3]], PARAMS)
    assert len(out[0].outputs[0].token_ids) == PARAMS.max_tokens


def _steps(llm: LLM) -> dict[str, list[int]]:
    """A long prompt first, chunked over many steps, and nine short ones decoding beside
    its chunks: the long one comes first in each step's batch, the decodes after it."""
    engine = llm.engine
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("long", [(5 * i) % 400 + 1 for i in range(60)], params)
    for i in range(9):
        engine.add_request(f"s{i}", [3 + i, 40 + i, 7], params)
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step()}
    return {rid: o.outputs[0].token_ids for rid, o in outs.items()}


def test_with_the_pieces_a_mixed_steps_decodes_go_through_the_decode_kernel(model_dir, monkeypatch):
    """On the Triton kernels (the CPU's interpreter), the piece graphs' steps send a mixed
    step's decodes through the decode kernel apart from the prompt chunk; the tokens are
    those of the plain eager pass on the same kernels."""
    from engine.attention import triton_backend

    batches = []
    plain_decode = triton_backend.decode_attention

    def spy(q, *args, **kwargs):
        batches.append(q.shape[0])
        return plain_decode(q, *args, **kwargs)

    options = dict(device="cpu", kernels="triton", max_num_batched_tokens=40,
                   max_prefill_chunk=8)  # fmt: skip
    want = _steps(LLM(model_dir("tiny-llama"), **options))
    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    monkeypatch.setattr(piece_graphs, "BUCKET", 8)  # few padded rows: the interpreter is slow
    pieces = LLM(model_dir("tiny-llama"), piece_graphs=True, **options)
    assert _steps(pieces) == want
    # eight of the nine decodes beside the long prompt's chunk (a multiple of four), moved
    # before it; the ninth with the chunk in the extend kernel
    assert 8 in batches


def test_decodes_first_moves_one_token_sequences_ahead_in_order():
    seqs, new, tables = ["long", "a", "mid", "b"], [8, 1, 3, 1], [[0], [1], [2], [3]]
    assert decodes_first(seqs, new, tables) == (["a", "b", "long", "mid"], [1, 1, 8, 3],
                                                [[1], [3], [0], [2]])  # fmt: skip
    assert decodes_first(["a", "x"], [1, 5], [[1], [2]]) == (["a", "x"], [1, 5], [[1], [2]])
