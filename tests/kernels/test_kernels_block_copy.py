"""The KV block copy (kernels/block_copy.py) against its reference: exactly the
planned blocks move, byte for byte, whatever the ids' shape, the dtype or the
block's odd size; the Triton kernel runs here through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels import block_copy, reference


def caches(seed: int, dtype, shape=(20, 2, 3, 2, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 50).to(dtype)


CASES = [
    ([4, 5, 6, 10, 11], [0, 1, 2, 7, 8], 2),  # few runs: one copy each
    (list(range(2, 12)), [19, 0, 7, 3, 5, 11, 13, 15, 17, 9], 10),  # src one range
    ([19, 0, 7, 3, 5, 11, 13, 15, 17, 9], list(range(2, 12)), 10),  # dst one range
    ([19, 0, 7, 3, 5, 11, 13, 15, 17, 9], [1, 3, 5, 7, 9, 11, 13, 15, 17, 0], 10),
    ([3], [3], 1),  # one block onto itself
    ([], [], 0),
]


@pytest.mark.parametrize(("src_ids", "dst_ids", "runs"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("kernel", ["copy_blocks", "triton_copy"])
def test_copy_moves_exactly_the_planned_blocks(src_ids, dst_ids, runs, dtype, kernel):
    if kernel == "triton_copy" and block_copy.triton is None:
        pytest.skip("no Triton")
    # 2*3*2*5 = 60 elements a block: odd word counts for every integer width
    src, dst = caches(31, dtype), caches(32, dtype)
    want = dst.clone()
    reference.copy_blocks(src, want, src_ids, dst_ids)
    index = [torch.tensor(ids, dtype=torch.long) for ids in (src_ids, dst_ids)]
    plan = block_copy.make_copy_plan(src_ids, dst_ids, *index)
    assert len(plan.runs) == runs
    getattr(block_copy, kernel)(src, dst, plan)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


def test_triton_copy_refuses_mismatched_blocks():
    src, dst = caches(1, torch.float32), caches(2, torch.float32, (20, 2, 3, 2, 4))
    plan = block_copy.make_copy_plan([1], [2], torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(ValueError, match="blocks differ"):
        block_copy.triton_copy(src, dst, plan)
