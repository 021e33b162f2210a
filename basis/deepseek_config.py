"""The DeepSeek-V2/V3 fields of a Hugging Face `config.json`: multi-head
latent attention (MLA) shapes and the expert routing, checked so that a
checkpoint the engine would compute wrongly is refused up front.

Routing, as transformers computes it:
- V2 (`DeepseekV2ForCausalLM`): softmax scores; `greedy` top-k, or
  `group_limited_greedy` (groups ranked by their best expert, `topk_group` kept).
- V3 (`DeepseekV3ForCausalLM`): `noaux_tc`, sigmoid scores plus a per-expert
  correction bias that only steers the choice; groups ranked by the sum of
  their two best biased scores.
Both multiply the routing weights by `routed_scaling_factor`.
"""

from __future__ import annotations

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

_V2_METHODS = ("greedy", "group_limited_greedy")


def deepseek_fields(arch: str, cfg: dict, heads: int) -> dict:
    """ModelConfig keyword arguments for a DeepSeek config; ValueError if unsupported."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise ValueError(f"config.json field {key!r} must be a positive int, got "
                             f"{cfg.get(key)!r}")  # fmt: skip
    if cfg["qk_rope_head_dim"] % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {cfg['qk_rope_head_dim']}")
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise ValueError(f"q_lora_rank must be null or a positive int, got {q_lora!r}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("DeepSeek checkpoints with attention or MLP biases are not supported")
    v3 = arch == "DeepseekV3ForCausalLM"
    experts = int(cfg.get("n_routed_experts") or 0)
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if v3 and (scoring, method) != ("sigmoid", "noaux_tc"):
        raise ValueError(f"DeepSeek-V3 routing is sigmoid scoring with noaux_tc; got "
                         f"scoring_func={scoring!r}, topk_method={method!r}")  # fmt: skip
    if not v3 and (scoring != "softmax" or method not in _V2_METHODS):
        raise ValueError(f"DeepSeek-V2 routing is softmax scoring with {_V2_METHODS}; got "
                         f"scoring_func={scoring!r}, topk_method={method!r}")  # fmt: skip
    grouped = method != "greedy"
    groups = int(cfg.get("n_group") or 1) if grouped else 1
    kept = int(cfg.get("topk_group") or 1) if grouped else 1
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts:
        if groups < 1 or experts % groups or not 1 <= kept <= groups:
            raise ValueError(f"n_group={groups} must divide n_routed_experts={experts} and "
                             f"topk_group={kept} lie in [1, n_group]")  # fmt: skip
        per_group = experts // groups
        if v3 and per_group < 2:
            raise ValueError("noaux_tc ranks groups by their two best experts: n_group must "
                             "leave at least 2 experts per group")  # fmt: skip
        if not 1 <= top_k <= kept * per_group:
            raise ValueError(f"num_experts_per_tok={top_k} must lie in [1, {kept * per_group}] "
                             f"(the experts of the kept groups)")  # fmt: skip
    return dict(
        q_lora_rank=q_lora,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        # V2's complex rotary always pairs adjacent dims; V3 does when rope_interleave.
        rope_interleave=True if not v3 else bool(cfg.get("rope_interleave", True)),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
        scoring_func=scoring,
        topk_method=method,
        n_group=groups,
        topk_group=kept,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
    )
