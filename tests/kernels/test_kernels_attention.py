"""The Triton paged attention kernels against the torch reference.

Off CUDA these run through Triton's interpreter (conftest sets TRITON_INTERPRET
before the kernel modules are imported), so shapes stay tiny. Block tables
use scattered block ids; lengths hit 1, page boundaries and odd values.
"""

from __future__ import annotations

import pytest
import torch
from attention_batches import CAPABILITY, DEVICE, MIXED, SCALE, make_batch

from engine.attention import triton_backend
from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_backend import SPLIT_DECODES, TritonAttentionBackend
from kernels.attention_reference import paged_attention
from kernels.decode_attention import choose_num_splits, decode_attention, split_kv_decode
from kernels.extend_attention import EXTEND_CONFIGS, extend_attention, flash_extend, tma_extend
from kernels.extend_attention import SELECTOR as EXTEND_SELECTOR
from kernels.extend_attention_tma import TMA_CONFIGS, flash_extend_tma, tma_inputs_ok

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference(b, query_lens, seq_lens):
    """The torch reference in float32 on the same (already rounded) inputs."""
    return paged_attention(
        b["q"].float().cpu(), b["cache"].float().cpu(), b["block_tables"].cpu(),
        query_lens, seq_lens, SCALE,
    )  # fmt: skip


def assert_matches(out, expected, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


def run_decode(b, seq_lens, **kwargs):
    return decode_attention(
        b["q"], b["cache"], b["block_tables"], b["seq_lens"], SCALE, max(seq_lens), **kwargs
    )


def run_extend(b, query_lens, **kwargs):
    return extend_attention(
        b["q"], b["k"], b["v"], b["cache"], b["block_tables"], b["query_start_loc"],
        b["seq_lens"], max(query_lens), SCALE, **kwargs,
    )  # fmt: skip


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(2, 1, 32), (2, 4, 16), (1, 8, 32)]  # (kv_heads, group, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("kv_heads,group,head_dim", SHAPES)
def test_decode_matches_reference(dtype, block_size, kv_heads, group, head_dim):
    seq_lens = [1, 16, 32, 37, 5]
    b = make_batch([1] * 5, seq_lens, kv_heads, group, head_dim, block_size, dtype)
    assert_matches(run_decode(b, seq_lens), reference(b, [1] * 5, seq_lens), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("kv_heads,group,head_dim", SHAPES)
def test_extend_mixed_batch_matches_reference(dtype, block_size, kv_heads, group, head_dim):
    query_lens, seq_lens = MIXED
    b = make_batch(query_lens, seq_lens, kv_heads, group, head_dim, block_size, dtype)
    assert_matches(run_extend(b, query_lens), reference(b, query_lens, seq_lens), dtype)


@pytest.mark.parametrize("prompts", [([6, 13], [30, 13]), ([], [])])
def test_a_mixed_steps_decodes_run_apart_from_its_prompt_chunks_and_match(prompts, monkeypatch):
    """The backend sends a mixed step's leading one-token sequences through the decode
    kernel and its prompt chunks through the extend kernel, into one output."""
    decodes = SPLIT_DECODES + 1
    batches = []
    plain = triton_backend.decode_attention

    def spy(q, *args, **kwargs):
        batches.append(q.shape[0])
        return plain(q, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", spy)
    query_lens = [1] * decodes + prompts[0]
    seq_lens = [3 + 7 * i for i in range(decodes)] + prompts[1]
    b = make_batch(query_lens, seq_lens, 2, 4, 16, 8, torch.float32, seed=6)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device=DEVICE),
        query_start_loc=b["query_start_loc"], seq_lens=b["seq_lens"],
        block_tables=b["block_tables"], query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
    )  # fmt: skip
    assert meta.num_decodes == decodes
    backend = TritonAttentionBackend()
    out = backend.attend(b["q"], b["k"], b["v"], b["cache"], meta, SCALE)
    assert batches == ([decodes] if not prompts[0] else [])  # off by default
    backend.split_mixed_steps(max(seq_lens))
    out = backend.attend(b["q"], b["k"], b["v"], b["cache"], meta, SCALE)
    assert_matches(out, reference(b, query_lens, seq_lens), torch.float32)
    # the decode kernel took the one-token sequences alone: 8 of 9 (a multiple of 4)
    assert batches[-1] == (decodes if not prompts[0] else 8)


def test_decode_does_not_depend_on_splits():
    seq_lens = [1, 150, 64, 97]
    b = make_batch([1] * 4, seq_lens, 2, 4, 16, 8, torch.float32, seed=3)
    expected = reference(b, [1] * 4, seq_lens)
    outs = []
    for num_splits in (1, 2, 3, 4, 8):  # 8 leaves splits past the end of most sequences
        out = split_kv_decode(
            b["q"], b["cache"], b["block_tables"], b["seq_lens"], SCALE, max(seq_lens),
            torch.empty_like(b["q"]), block_n=16, num_warps=4, num_stages=2,
            programs_per_sm=4, num_splits=num_splits,
        )  # fmt: skip
        assert_matches(out, expected, torch.float32)
        outs.append(out)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_rows_give_zeros(num_splits):
    """A row with seq_len 0 (padding in a captured batch) comes out as zeros, not NaN."""
    b = make_batch([1, 1], [5, 40], 2, 2, 16, 4, torch.float32, seed=4)
    expected = reference(b, [1, 1], [5, 40])
    b["seq_lens"][0] = 0
    out = split_kv_decode(
        b["q"], b["cache"], b["block_tables"], b["seq_lens"], SCALE, 40,
        torch.full_like(b["q"], float("nan")), block_n=16, num_warps=4, num_stages=2,
        programs_per_sm=4, num_splits=num_splits,
    )  # fmt: skip
    assert torch.equal(out[0].cpu(), torch.zeros_like(expected[0]))
    assert_matches(out[1], expected[1], torch.float32)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32), (32, 16), (64, 32)])
def test_extend_tilings(block_m, block_n):
    """Several query tiles per sequence, whole and partial prefix tiles, off-diagonal tiles."""
    query_lens, seq_lens = [40, 3, 1, 19], [40, 36, 70, 51]  # prefixes 0, 33, 69, 32
    b = make_batch(query_lens, seq_lens, 2, 2, 16, 8, torch.float32, seed=5)
    out = flash_extend(
        b["q"], b["k"], b["v"], b["cache"], b["block_tables"], b["query_start_loc"],
        b["seq_lens"], max(query_lens), SCALE, torch.empty_like(b["q"]),
        block_m=block_m, block_n=block_n, num_warps=4, num_stages=2,
    )  # fmt: skip
    assert_matches(out, reference(b, query_lens, seq_lens), torch.float32)


def test_strided_views_and_out_buffer():
    """q, k, v sliced from a fused projection; the result lands in the given out."""
    query_lens, seq_lens = [3, 1], [10, 17]
    b = make_batch(query_lens, seq_lens, 2, 4, 16, 4, torch.float32, seed=7)
    expected = reference(b, query_lens, seq_lens)
    fused = torch.cat([b["q"], b["k"], b["v"]], dim=1)  # [T, Hq + 2 Hk, D]
    b["q"], b["k"], b["v"] = fused[:, :8], fused[:, 8:10], fused[:, 10:]
    out = torch.full_like(expected, float("nan"), device=DEVICE)
    assert run_extend(b, query_lens, out=out) is out
    assert_matches(out, expected, torch.float32)

    decode = make_batch([1, 1], [9, 33], 2, 4, 16, 4, torch.float32, seed=8)
    expected = reference(decode, [1, 1], [9, 33])
    wider = torch.zeros(2, 12, 16, device=DEVICE)
    wider[:, 2:10] = decode["q"]
    decode["q"] = wider[:, 2:10]
    assert_matches(run_decode(decode, [9, 33]), expected, torch.float32)


def test_extend_decode_rows_equal_decode_kernel():
    seq_lens = [7, 33, 16]
    b = make_batch([1, 1, 1], seq_lens, 2, 4, 32, 16, torch.float32, seed=9)
    assert_matches(run_extend(b, [1, 1, 1]), run_decode(b, seq_lens).cpu(), torch.float32)


def test_num_splits_policy():
    assert choose_num_splits(64, 8, 4096, 64, 4, 132) == 2
    assert choose_num_splits(8, 8, 32768, 64, 4, 132) == 8
    assert choose_num_splits(8, 8, 32768, 64, 8, 132) == 16
    assert choose_num_splits(256, 8, 4096, 64, 4, 132) == 1
    assert choose_num_splits(1, 1, 100, 64, 4, 132) == 1  # too short to split
    assert choose_num_splits(1, 1, 10**6, 64, 8, 132) == 64  # capped


def test_empty_batches():
    b = make_batch([1], [4], 1, 1, 16, 4, torch.float32)
    empty_q = b["q"][:0]
    out = decode_attention(empty_q, b["cache"], b["block_tables"][:0], b["seq_lens"][:0],
                           SCALE, 0)  # fmt: skip
    assert out.shape == (0, 1, 16)


def _decode_args(**change):
    b = make_batch([1, 1], [5, 9], 2, 2, 16, 4, torch.float32)
    args = dict(q=b["q"], cache=b["cache"], block_tables=b["block_tables"],
                seq_lens=b["seq_lens"], scale=SCALE, max_seq_len=9)  # fmt: skip
    args.update({k: fn(args) for k, fn in change.items()})
    return args


DECODE_ERRORS = {
    "q 2-D": dict(q=lambda a: a["q"][:, 0]),
    "q float64": dict(q=lambda a: a["q"].double()),
    "cache dtype": dict(cache=lambda a: a["cache"].half()),
    "cache 4-D": dict(cache=lambda a: a["cache"][:, 0]),
    "cache not contiguous": dict(cache=lambda a: torch.cat([a["cache"]] * 2)[::2]),
    "head_dim mismatch": dict(q=lambda a: a["q"][..., :8].contiguous()),
    "heads not a multiple": dict(q=lambda a: a["q"][:, :3].contiguous()),
    "q last dim strided": dict(q=lambda a: torch.cat([a["q"], a["q"]], -1)[..., ::2]),
    "block_tables int64": dict(block_tables=lambda a: a["block_tables"].long()),
    "block_tables rows": dict(block_tables=lambda a: a["block_tables"][:1]),
    "seq_lens shape": dict(seq_lens=lambda a: a["seq_lens"][:1]),
    "seq_lens int64": dict(seq_lens=lambda a: a["seq_lens"].long()),
    "max_seq_len tensor": dict(max_seq_len=lambda a: torch.tensor(9)),
    "out shape": dict(out=lambda a: torch.empty(2, 4, 8)),
}


@pytest.mark.parametrize("case", sorted(DECODE_ERRORS))
def test_decode_rejects_bad_inputs(case):
    with pytest.raises(ValueError):
        decode_attention(**_decode_args(**DECODE_ERRORS[case]))


EXTEND_ERRORS = {
    "k heads": dict(k=lambda a: a["k"][:, :1]),
    "v tokens": dict(v=lambda a: a["v"][:2]),
    "k dtype": dict(k=lambda a: a["k"].half()),
    "query_start_loc length": dict(query_start_loc=lambda a: a["query_start_loc"][:2]),
    "query_start_loc int64": dict(query_start_loc=lambda a: a["query_start_loc"].long()),
    "seq_lens 2-D": dict(seq_lens=lambda a: a["seq_lens"][None]),
    "max_query_len float": dict(max_query_len=lambda a: 3.0),
    "out dtype": dict(out=lambda a: torch.empty_like(a["q"]).half()),
}


@pytest.mark.parametrize("case", sorted(EXTEND_ERRORS))
def test_extend_rejects_bad_inputs(case):
    b = make_batch([3, 1], [3, 6], 2, 2, 16, 4, torch.float32)
    args = dict(b, max_query_len=3, scale=SCALE)
    args.update({k: fn(args) for k, fn in EXTEND_ERRORS[case].items()})
    with pytest.raises(ValueError):
        extend_attention(**args)


# The TMA kernel (a GPU variant, sm_90+) runs here through the interpreter, which reads
# descriptor boxes as masked loads: past a descriptor's rows it gives zeros, inside them
# the real neighbouring rows, as the TMA engine does. On a GPU it runs for real where the
# hardware has TMA.
needs_tma = pytest.mark.skipif(CAPABILITY is not None and CAPABILITY < (9, 0),
                               reason="TMA needs sm_90 or newer")  # fmt: skip


def run_kernel(kernel, b, query_lens, out=None, **config):
    args = (
        b["q"], b["k"], b["v"], b["cache"], b["block_tables"], b["query_start_loc"],
        b["seq_lens"], max(query_lens), SCALE,
    )  # fmt: skip
    return kernel(*args, torch.empty_like(b["q"]) if out is None else out, **config)


@needs_tma
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,group,head_dim", SHAPES)
def test_tma_kernel_mixed_batch_matches_reference(dtype, kv_heads, group, head_dim):
    query_lens, seq_lens = MIXED
    b = make_batch(query_lens, seq_lens, kv_heads, group, head_dim, 8, dtype)
    assert tma_inputs_ok(b["q"], b["k"], b["v"], SCALE)
    out = run_kernel(flash_extend_tma, b, query_lens, block_m=16, block_n=16, num_warps=4,
                     num_stages=2)  # fmt: skip
    assert_matches(out, reference(b, query_lens, seq_lens), dtype)


@needs_tma
@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32), (32, 16), (64, 64), (64, 128)])
def test_tma_kernel_tilings(block_m, block_n, pipeline):
    """Several query tiles, whole and partial prefix tiles (PREFIX_N = min(block_n, 32)),
    off-diagonal tiles, and last tiles straddling a sequence's end into the next one; with
    the scores pipelined one tile ahead too (the first diagonal tile whole, straddling,
    or the only one, after zero or more off-diagonal tiles)."""
    query_lens, seq_lens = [40, 3, 1, 19, 70], [40, 36, 70, 51, 70]
    b = make_batch(query_lens, seq_lens, 2, 2, 16, 8, torch.float32, seed=5)
    out = run_kernel(flash_extend_tma, b, query_lens, block_m=block_m, block_n=block_n,
                     num_warps=4, num_stages=2, pipeline=pipeline)  # fmt: skip
    assert_matches(out, reference(b, query_lens, seq_lens), torch.float32)


@pytest.mark.parametrize(
    "kernel",
    ["flash", pytest.param("tma", marks=needs_tma), pytest.param("tma_pipeline", marks=needs_tma)],
)
def test_rows_past_a_sequence_never_leak(kernel):
    """The last sequence's diagonal tile reaches rows past its end (padding, as in a
    padded batch): NaN there must not reach any stored row (0 * NaN is NaN), and rows
    outside every sequence are not written."""
    query_lens, seq_lens = [5, 21], [5, 29]
    b = make_batch(query_lens, seq_lens, 2, 2, 16, 8, torch.bfloat16, seed=11)
    expected = reference(b, query_lens, seq_lens)
    pad = 11
    for name in ("q", "k", "v"):
        x = b[name]
        b[name] = torch.cat(
            [x, torch.full((pad, *x.shape[1:]), float("nan"), dtype=x.dtype, device=x.device)]
        )
    out = torch.full_like(b["q"], 7.0)
    fn = {"flash": flash_extend, "tma": flash_extend_tma, "tma_pipeline": flash_extend_tma}[kernel]
    extra = {"pipeline": True} if kernel == "tma_pipeline" else {}
    run_kernel(fn, b, query_lens, out=out, block_m=16, block_n=32, num_warps=4, num_stages=2,
               **extra)  # fmt: skip
    assert_matches(out[:-pad], expected, torch.bfloat16)
    assert torch.equal(out[-pad:].cpu(), torch.full_like(out[-pad:].cpu(), 7.0))


@needs_tma
def test_tma_on_fused_projection_views_and_fallbacks():
    """q, k, v split from one qkv projection suit TMA (rows 16-byte aligned, heads
    packed); inputs that do not (a head_dim that is not a power of 2, heads not packed)
    make the "tma" variant run the pointer kernel, with the same result (a pipelined
    config too: the pointer kernel has no such option and ignores it)."""
    query_lens, seq_lens = [9, 1, 17], [9, 30, 40]
    b = make_batch(query_lens, seq_lens, 2, 4, 16, 4, torch.float32, seed=7)
    expected = reference(b, query_lens, seq_lens)
    fused = torch.cat([b["q"], b["k"], b["v"]], dim=1)  # [T, Hq + 2 Hk, D]
    b["q"], b["k"], b["v"] = fused[:, :8], fused[:, 8:10], fused[:, 10:]
    assert tma_inputs_ok(b["q"], b["k"], b["v"], SCALE)
    config = dict(block_m=16, block_n=16, num_warps=4, num_stages=2, pipeline=True)
    assert_matches(run_kernel(flash_extend_tma, b, query_lens, **config), expected, torch.float32)

    wide = torch.zeros(b["k"].shape[0], 4, 16, device=DEVICE)
    wide[:, ::2] = b["k"]
    strided = wide[:, ::2]  # heads 2 * D apart
    assert not tma_inputs_ok(b["q"], strided, b["v"], SCALE)
    b["k"] = strided
    assert_matches(run_kernel(tma_extend, b, query_lens, **config), expected, torch.float32)

    odd = make_batch(query_lens, seq_lens, 2, 1, 24, 4, torch.float32, seed=8)
    assert not tma_inputs_ok(odd["q"], odd["k"], odd["v"], SCALE)
    assert_matches(run_kernel(tma_extend, odd, query_lens, **config),
                   reference(odd, query_lens, seq_lens), torch.float32)  # fmt: skip


def test_gpu_variants_are_offered_only_where_they_run():
    cpu = [c.variant for c in EXTEND_SELECTOR.usable(torch.device("cpu"))]
    assert set(cpu) == {"flash"}
    assert {c.variant for c in EXTEND_SELECTOR.candidates} == {"flash", "tma"}


def test_tuning_checks_against_the_pointer_kernel_and_stays_short():
    """The tuner's verify reference is the first candidate: the pointer kernel with its
    first config. Every prefill shape is tuned at start-up, so the list stays short."""
    first = EXTEND_SELECTOR.candidates[0]
    assert first.variant == "flash" and first.kwargs == EXTEND_CONFIGS[0]
    assert len(EXTEND_SELECTOR.candidates) == len(EXTEND_CONFIGS) + len(TMA_CONFIGS) <= 15
    assert len({(c.variant, c.config) for c in EXTEND_SELECTOR.candidates}) == len(
        EXTEND_SELECTOR.candidates
    )
