"""Where each Hugging Face checkpoint tensor lives in our fused parameters.

q/k/v projections are rows of one qkv matrix, gate/up projections rows of
one gate_up matrix, and routed experts slices of stacked [E, ...] tensors.
The same table drives loading (with shape checks) and `make-model` (which
writes random tensors under these names).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class Target:
    param: str  # our parameter's name in CausalLM.named_parameters()
    index: tuple  # where inside it: () for the whole tensor, else slices / ints

    def view(self, tensor):
        return tensor[self.index] if self.index else tensor


def _rows(start: int, stop: int) -> tuple:
    return (slice(start, stop),)


def hf_weight_targets(config: ModelConfig) -> dict[str, Target]:
    q, kv = config.q_size, config.kv_size
    out: dict[str, Target] = {
        "model.embed_tokens.weight": Target("embed_tokens", ()),
        "model.norm.weight": Target("norm.weight", ()),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Target("lm_head", ())
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        out[f"{hf}.input_layernorm.weight"] = Target(f"{ours}.input_layernorm.weight", ())
        out[f"{hf}.post_attention_layernorm.weight"] = Target(
            f"{ours}.post_attention_layernorm.weight", ()
        )
        qkv = f"{ours}.self_attn.qkv_proj"
        for name, rows in (("q", (0, q)), ("k", (q, q + kv)), ("v", (q + kv, q + 2 * kv))):
            out[f"{hf}.self_attn.{name}_proj.weight"] = Target(qkv, _rows(*rows))
            if config.attention_bias:
                out[f"{hf}.self_attn.{name}_proj.bias"] = Target(
                    f"{ours}.self_attn.qkv_bias", _rows(*rows)
                )
        out[f"{hf}.self_attn.o_proj.weight"] = Target(f"{ours}.self_attn.o_proj", ())
        if config.qk_norm:
            for name in ("q_norm", "k_norm"):
                out[f"{hf}.self_attn.{name}.weight"] = Target(f"{ours}.self_attn.{name}.weight", ())
        if config.is_moe_layer(i):
            out.update(_expert_targets(config, hf, ours))
        else:
            width = config.intermediate_size
            out[f"{hf}.mlp.gate_proj.weight"] = Target(f"{ours}.mlp.gate_up_proj", _rows(0, width))
            out[f"{hf}.mlp.up_proj.weight"] = Target(
                f"{ours}.mlp.gate_up_proj", _rows(width, 2 * width)
            )
            out[f"{hf}.mlp.down_proj.weight"] = Target(f"{ours}.mlp.down_proj", ())
    return out


def _expert_targets(config: ModelConfig, hf: str, ours: str) -> dict[str, Target]:
    width = config.moe_intermediate_size
    gate, up = slice(0, width), slice(width, 2 * width)
    if config.architecture == "MixtralForCausalLM":
        block, names = f"{hf}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        block, names = f"{hf}.mlp", ("gate_proj", "up_proj", "down_proj")
    out = {f"{block}.gate.weight": Target(f"{ours}.mlp.gate", ())}
    for e in range(config.num_experts):
        prefix = f"{block}.experts.{e}"
        out[f"{prefix}.{names[0]}.weight"] = Target(f"{ours}.mlp.w13", (e, gate))
        out[f"{prefix}.{names[1]}.weight"] = Target(f"{ours}.mlp.w13", (e, up))
        out[f"{prefix}.{names[2]}.weight"] = Target(f"{ours}.mlp.w2", (e,))
    return out
