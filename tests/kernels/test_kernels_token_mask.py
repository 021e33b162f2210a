"""The grammar bitmask applied to logits (kernels/token_mask.py): the Triton kernel
(through Triton's interpreter here) and the torch reference each forbid exactly
the tokens whose bit is clear, in the listed rows only, at odd vocabulary sizes,
with logits wider than the bitmask, and in bf16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import token_mask


def expected(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """By unpacking each row's bits with numpy (bit t % 32 of word t // 32)."""
    want = logits.clone()
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        bits = np.unpackbits(bitmask[i].numpy().view(np.uint8), bitorder="little")[:vocab]
        forbidden = np.ones(vocab, dtype=bool)
        forbidden[: len(bits)] = bits == 0
        want[row, torch.from_numpy(forbidden)] = float("-inf")
    return want


CASES = [  # (logits rows, vocab, bitmask words, rows)
    (5, 77, 3, [4, 0, 2]),  # the bitmask covers 96 tokens: past the vocabulary
    (3, 100, 3, [1, 2]),  # logits wider than the bitmask (96): the rest forbidden
    (2, 2051, 65, [1, 0]),  # over two chunks of the kernel
    (4, 33, 2, []),  # no constrained row
]


@pytest.mark.parametrize(("n", "vocab", "words", "rows"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_triton", [False, True])
def test_exactly_the_forbidden_tokens_of_the_listed_rows_get_minus_inf(
    n, vocab, words, rows, dtype, use_triton
):
    if use_triton and token_mask.triton is None:
        pytest.skip("no Triton")
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(n, vocab, generator=g).to(dtype)
    # random words (the sign bit set in about half); one row allows a single token
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g,
                            dtype=torch.int64).to(torch.int32)  # fmt: skip
    if rows:
        bitmask[0] = 0
        bitmask[0, 1] = 1 << 3  # token 35 alone
    want = expected(logits, bitmask, rows)
    token_mask.apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.long),
                                    use_triton=use_triton)  # fmt: skip
    assert torch.equal(logits, want)
    if rows and vocab > 35:
        assert torch.isfinite(logits[rows[0]]).sum() == 1


def test_a_malformed_bitmask_is_refused():
    logits = torch.zeros(2, 40)
    with pytest.raises(ValueError, match="int32"):
        token_mask.apply_token_bitmask_(logits, torch.zeros(1, 2, dtype=torch.int64),
                                        torch.tensor([0]))  # fmt: skip
    with pytest.raises(ValueError, match="one logits row each"):
        token_mask.apply_token_bitmask_(logits, torch.zeros(1, 2, dtype=torch.int32),
                                        torch.tensor([0, 1]))  # fmt: skip
