"""A grammar's token bitmask applied to a step's logits in place: every token a
row's bitmask forbids gets -inf. The bitmask is int32, one bit per token (bit
`t % 32` of word `t // 32`), a row per constrained sequence; `rows` says which
logits row each bitmask row is for. Tokens past the bitmask's last word (logits
wider than the grammar's vocabulary) are forbidden.

On CUDA one Triton launch does it: a program per bitmask row and chunk of the
vocabulary reads the chunk's words and writes -inf where a bit is clear, one
pass that never reads the logits. The torch reference (the CPU's path) unpacks
the bits into a boolean mask, which on the device took about a dozen passes
over [rows, vocab] tensors.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - no Triton: the torch reference instead
    triton = None

_NEG_INF = float("-inf")
CHUNK = 1024  # tokens a program covers


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, use_triton: bool | None = None
) -> None:
    """Sets `logits[rows[i], t]` to -inf for every token t that bitmask row i forbids.
    `logits` [N, V] (rows contiguous), `bitmask` [R, W] int32 and `rows` [R] on its
    device. `use_triton`: None picks the kernel for CUDA tensors, the reference otherwise."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or rows.shape != bitmask.shape[:1]:
        raise ValueError("the bitmask must be [rows, words] int32 with one logits row each")
    if use_triton is None:
        use_triton = logits.is_cuda and triton is not None
    if bitmask.shape[0] == 0:
        return
    if use_triton:
        _apply_triton(logits, bitmask.contiguous(), rows)
    else:
        reference_apply_(logits, bitmask, rows)


def reference_apply_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # logits wider than the grammar's vocabulary
        pad = allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], _NEG_INF)


def _apply_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.stride(1) != 1:
        raise ValueError("each logits row must be contiguous")
    vocab = logits.shape[1]
    grid = (bitmask.shape[0], triton.cdiv(vocab, CHUNK))
    _mask_kernel[grid](logits, bitmask, rows, vocab, bitmask.shape[1], logits.stride(0),
                       CHUNK=CHUNK)  # fmt: skip


if triton is not None:

    @triton.jit
    def _mask_kernel(logits, bitmask, rows, vocab, words, stride, CHUNK: tl.constexpr):
        # Program (i, c): tokens [c * CHUNK, (c + 1) * CHUNK) of bitmask row i.
        i = tl.program_id(0)
        row = tl.load(rows + i).to(tl.int64)
        tokens = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        inside = tokens < vocab
        word = tl.load(bitmask + i.to(tl.int64) * words + tokens // 32,
                       mask=inside & (tokens < words * 32), other=0)  # fmt: skip
        allowed = ((word >> (tokens % 32)) & 1) != 0
        value = tl.full([CHUNK], float("-inf"), tl.float32).to(logits.dtype.element_ty)
        tl.store(logits + row * stride + tokens, value, mask=inside & ~allowed)
