"""`make-model` presets of DeepSeek-V2/V3 (multi-head latent attention, shared
and routed experts): two tiny ones with weights for CPU tests against
transformers, and DeepSeek-V2-Lite's published config for dummy-weight runs."""

from __future__ import annotations

_TINY = {  # MLA and MoE at a few MB; odd-sized latent (32 + 8) on purpose
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _tiny_yarn(mscale: float, mscale_all_dim: float) -> dict:
    """The tiny presets' YaRN scaling: 16 x 256 = their max_position_embeddings."""
    return {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


DEEPSEEK_PRESETS: dict[str, dict] = {
    "tiny-deepseek-v2": {  # V2-Lite's shape of things: no q LoRA, greedy softmax routing
        **_TINY,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        "n_shared_experts": 2,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "rope_scaling": _tiny_yarn(mscale=0.707, mscale_all_dim=0.707),
    },
    "tiny-deepseek-v3": {  # V3's: q LoRA, noaux_tc over 4 groups, interleaved rotary
        **_TINY,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "q_lora_rank": 24,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_interleave": True,
        "num_nextn_predict_layers": 1,
        # mscale != mscale_all_dim gives the rotary table an attention factor (1.057) too.
        "rope_scaling": _tiny_yarn(mscale=1.0, mscale_all_dim=0.8),
    },
    "deepseek-v2-lite": {  # the published config (deepseek-ai/DeepSeek-V2-Lite)
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
