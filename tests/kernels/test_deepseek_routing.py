"""DeepSeek expert routing: the Triton kernel equals the torch reference, and
both equal transformers' routers (V2 greedy / group-limited softmax, V3
noaux_tc sigmoid with its correction bias), including the case where biased
scores go negative."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.grouped_topk import grouped_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (experts, groups, kept groups, top_k, scoring, renormalise, scaling)
CASES = [
    (8, 4, 2, 2, "sigmoid", True, 2.5),  # tiny-deepseek-v3
    (256, 8, 4, 8, "sigmoid", True, 2.5),  # DeepSeek-V3
    (12, 3, 2, 3, "softmax", False, 1.5),  # V2 group_limited_greedy, odd sizes
    (160, 8, 3, 6, "softmax", False, 16.0),  # DeepSeek-V2
    (64, 1, 1, 6, "softmax", False, 1.0),  # one group: plain greedy (V2-Lite)
    (6, 3, 1, 2, "sigmoid", False, 1.0),  # top_k = every expert of the kept group
]


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def by_expert(weights, ids):
    """{(token, expert): weight}: routers may list a token's experts in any order."""
    return {(t, e): w for t, (row_w, row_i) in enumerate(zip(weights.tolist(), ids.tolist()))
            for w, e in zip(row_w, row_i)}  # fmt: skip


def assert_same_routing(got, want):
    got, want = by_expert(*got), by_expert(*want)
    assert got.keys() == want.keys()
    for key, w in want.items():
        assert got[key] == pytest.approx(w, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("experts,groups,kept,top_k,scoring,renormalize,scaling", CASES)
def test_kernel_matches_reference(experts, groups, kept, top_k, scoring, renormalize, scaling):
    logits = randn(9, experts, seed=experts)
    bias = randn(experts, seed=1) * 0.5
    args = (top_k, groups, kept, renormalize, scaling, scoring, bias)
    weights, ids = grouped_topk(logits, *args)
    ref_weights, ref_ids = reference.grouped_topk(logits.cpu(), *args[:-1], bias.cpu())
    assert torch.equal(ids.cpu(), ref_ids)  # both ordered by decreasing choice score
    torch.testing.assert_close(weights.cpu(), ref_weights, atol=1e-6, rtol=1e-5)


def _v3_router(experts, groups, kept, top_k, hidden=16):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=hidden, n_routed_experts=experts, n_group=groups, topk_group=kept,
        num_experts_per_tok=top_k, norm_topk_prob=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    return DeepseekV3TopkRouter(config)


def test_v3_routing_equals_transformers_when_biased_scores_go_negative():
    """Sigmoid scores lie in (0, 1); a correction bias of -2 makes every biased score
    negative. transformers >= 5 masks the dropped groups' experts with -inf, as vLLM and
    SGLang do, so the top-k stays inside the kept groups; older transformers masked with
    0.0, which here would outrank every kept expert and pick dropped ones instead."""
    experts, groups, kept, top_k = 8, 4, 2, 2
    router = _v3_router(experts, groups, kept, top_k)
    hidden = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 16, generator=torch.Generator().manual_seed(4)))
        router.e_score_correction_bias.fill_(-2.0)
        _, hf_weights, hf_ids = router(hidden)
    logits = F.linear(hidden, router.weight)
    bias = router.e_score_correction_bias
    args = (top_k, groups, kept, True, 2.5, "sigmoid")
    ours = reference.grouped_topk(logits, *args, bias)
    assert_same_routing(ours, (hf_weights, hf_ids))
    assert_same_routing(grouped_topk(logits.to(DEVICE), *args, bias.to(DEVICE)), ours)
    # What masking with 0.0 would have chosen: experts of groups the step dropped.
    choice = logits.sigmoid() + bias
    group_scores = choice.view(5, groups, -1).topk(2, dim=-1).values.sum(-1)
    kept_mask = torch.zeros(5, groups, dtype=torch.bool).scatter_(
        1, group_scores.topk(kept, dim=-1).indices, True
    )
    zero_masked = choice.masked_fill(~kept_mask.repeat_interleave(experts // groups, 1), 0.0)
    zero_ids = zero_masked.topk(top_k, dim=-1).indices
    assert not kept_mask.gather(1, zero_ids // (experts // groups)).any()
    assert kept_mask.gather(1, ours[1] // (experts // groups)).all()


def test_v3_routing_equals_transformers_with_random_bias():
    router = _v3_router(256, 8, 4, 8, hidden=32)
    hidden = torch.randn(7, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        router.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(6))
        router.e_score_correction_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
        _, hf_weights, hf_ids = router(hidden)
    logits = F.linear(hidden, router.weight)
    ours = reference.grouped_topk(logits, 8, 8, 4, True, 2.5, "sigmoid",
                                  router.e_score_correction_bias)  # fmt: skip
    assert_same_routing(ours, (hf_weights, hf_ids))


@pytest.mark.parametrize("method,groups,kept", [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_v2_routing_equals_transformers(method, groups, kept):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(
        hidden_size=16, num_attention_heads=4, n_routed_experts=16, n_group=groups,
        topk_group=kept,
        num_experts_per_tok=3, topk_method=method, routed_scaling_factor=1.5,
    )  # fmt: skip
    router = DeepseekV2TopkRouter(config)
    hidden = torch.randn(6, 16, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        router.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(9))
        _, hf_weights, hf_ids = router(hidden)
    logits = F.linear(hidden, router.weight)
    ours = reference.grouped_topk(logits, 3, groups, kept, False, 1.5, "softmax")
    assert_same_routing(ours, (hf_weights, hf_ids))


def test_bad_routing_inputs_raise_value_error():
    logits = randn(3, 8, seed=0)
    with pytest.raises(ValueError, match="num_groups"):
        grouped_topk(logits, 2, 3, 1, False, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        grouped_topk(logits, 5, 4, 2, False, 1.0)
    with pytest.raises(ValueError, match="correction_bias"):
        grouped_topk(logits, 2, 4, 2, True, 1.0, "sigmoid")
    with pytest.raises(ValueError, match="scoring"):
        grouped_topk(logits, 2, 4, 2, True, 1.0, "relu")
