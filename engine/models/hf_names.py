"""Where each Hugging Face checkpoint tensor lives in our fused parameters.

q/k/v projections are rows of one qkv matrix, gate/up projections rows of
one gate_up matrix, and routed experts slices of stacked [E, ...] tensors.
The same table drives loading (with shape checks) and `make-model` (which
writes random tensors under these names).
"""

from __future__ import annotations

from dataclasses import dataclass

from basis.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class Target:
    param: str  # our parameter's name in CausalLM.named_parameters()
    index: tuple  # where inside it: () for the whole tensor, else slices / ints

    def view(self, tensor):
        return tensor[self.index] if self.index else tensor


def _rows(start: int, stop: int) -> tuple:
    return (slice(start, stop),)


def hf_weight_targets(config: ModelConfig, stage=None, mtp: bool = False) -> dict[str, Target]:
    """Every checkpoint tensor the model (or pipeline `stage`, a StagePlan) loads; with
    `mtp`, DeepSeek-V3's multi-token prediction layer's too (after the rest)."""
    q, kv = config.q_size, config.kv_size
    first, stop = stage.layers if stage is not None else (0, config.num_hidden_layers)
    embeds, heads = first == 0, stop == config.num_hidden_layers
    out: dict[str, Target] = {}
    if embeds:
        out["model.embed_tokens.weight"] = Target("embed_tokens", ())
    if heads:
        out["model.norm.weight"] = Target("norm.weight", ())
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = Target("lm_head", ())
        elif not embeds:  # the last stage's own copy of the tied embedding
            out["model.embed_tokens.weight"] = Target("lm_head", ())
    for i in range(first, stop):
        hf, ours = f"model.layers.{i}", f"layers.{i - first}"
        out[f"{hf}.input_layernorm.weight"] = Target(f"{ours}.input_layernorm.weight", ())
        out[f"{hf}.post_attention_layernorm.weight"] = Target(
            f"{ours}.post_attention_layernorm.weight", ()
        )
        if config.is_mla:
            out.update(_mla_targets(config, hf, ours))
            out.update(_mlp_targets(config, i, hf, ours))
            continue
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
        out.update(_mlp_targets(config, i, hf, ours))
    if mtp:
        out.update(_mtp_targets(config))
    return out


def _mtp_targets(config: ModelConfig) -> dict[str, Target]:
    """The MTP layer's own tensors (its embedding and head copies are not read: the
    main model's serve it)."""
    from engine.models.mtp import mtp_config

    config = mtp_config(config)
    i = config.num_hidden_layers
    hf, ours = f"model.layers.{i}", "mtp.block"
    out = {f"{hf}.{name}.weight": Target(f"mtp.{name}.weight", ()) for name in ("enorm", "hnorm")}
    out[f"{hf}.eh_proj.weight"] = Target("mtp.eh_proj", ())
    out[f"{hf}.shared_head.norm.weight"] = Target("mtp.norm.weight", ())
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{hf}.{norm}.weight"] = Target(f"{ours}.{norm}.weight", ())
    out.update(_mla_targets(config, hf, ours))
    out.update(_mlp_targets(config, i, hf, ours))
    return out


def _mlp_targets(config: ModelConfig, i: int, hf: str, ours: str) -> dict[str, Target]:
    if config.is_moe_layer(i):
        return _expert_targets(config, hf, ours)
    return _gate_up_down(f"{hf}.mlp", f"{ours}.mlp", config.intermediate_size)


def _gate_up_down(hf: str, ours: str, width: int) -> dict[str, Target]:
    return {
        f"{hf}.gate_proj.weight": Target(f"{ours}.gate_up_proj", _rows(0, width)),
        f"{hf}.up_proj.weight": Target(f"{ours}.gate_up_proj", _rows(width, 2 * width)),
        f"{hf}.down_proj.weight": Target(f"{ours}.down_proj", ()),
    }


def _mla_targets(config: ModelConfig, hf: str, ours: str) -> dict[str, Target]:
    """q_proj (or q_a_proj) and kv_a_proj_with_mqa are rows of one fused_qkv_a_proj."""
    attn, mine = f"{hf}.self_attn", f"{ours}.self_attn"
    q_in = config.q_lora_rank or config.q_size
    fused = f"{mine}.fused_qkv_a_proj"
    out = {
        f"{attn}.kv_a_proj_with_mqa.weight": Target(fused, _rows(q_in, q_in + config.latent_dim)),
        f"{attn}.kv_a_layernorm.weight": Target(f"{mine}.kv_a_layernorm.weight", ()),
        f"{attn}.kv_b_proj.weight": Target(f"{mine}.kv_b_proj", ()),
        f"{attn}.o_proj.weight": Target(f"{mine}.o_proj", ()),
    }
    if config.q_lora_rank is None:
        out[f"{attn}.q_proj.weight"] = Target(fused, _rows(0, q_in))
    else:
        out[f"{attn}.q_a_proj.weight"] = Target(fused, _rows(0, q_in))
        out[f"{attn}.q_a_layernorm.weight"] = Target(f"{mine}.q_a_layernorm.weight", ())
        out[f"{attn}.q_b_proj.weight"] = Target(f"{mine}.q_b_proj", ())
    return out


def ignored_tensor(config: ModelConfig, name: str) -> bool:
    """Checkpoint tensors the engine does not use: DeepSeek-V3's multi-token-prediction
    layers, stored as layers num_hidden_layers and up (transformers skips them too)."""
    if not config.is_mla or not name.startswith("model.layers."):
        return False
    index = name.split(".")[2]
    return index.isdigit() and int(index) >= config.num_hidden_layers


def _moe_block(config: ModelConfig, hf: str) -> tuple[str, tuple[str, str, str]]:
    """A MoE layer's checkpoint prefix and its experts' (gate, up, down) names."""
    if config.architecture == "MixtralForCausalLM":
        return f"{hf}.block_sparse_moe", ("w1", "w3", "w2")
    return f"{hf}.mlp", ("gate_proj", "up_proj", "down_proj")


def routed_expert_names(config: ModelConfig, layer: int) -> list[tuple[str, str, str]]:
    """The checkpoint names (gate, up, down) of each routed expert of model layer `layer`."""
    block, names = _moe_block(config, f"model.layers.{layer}")
    return [
        tuple(f"{block}.experts.{e}.{n}.weight" for n in names) for e in range(config.num_experts)
    ]


def _expert_targets(config: ModelConfig, hf: str, ours: str) -> dict[str, Target]:
    width = config.moe_intermediate_size
    gate, up = slice(0, width), slice(width, 2 * width)
    block, names = _moe_block(config, hf)
    out = {f"{block}.gate.weight": Target(f"{ours}.mlp.gate", ())}
    if config.scoring_func == "sigmoid":
        bias = Target(f"{ours}.mlp.e_score_correction_bias", ())
        out[f"{block}.gate.e_score_correction_bias"] = bias
    if config.n_shared_experts:
        shared = config.moe_intermediate_size * config.n_shared_experts
        out.update(_gate_up_down(f"{block}.shared_experts", f"{ours}.mlp.shared_experts", shared))
    for e in range(config.num_experts):
        prefix = f"{block}.experts.{e}"
        out[f"{prefix}.{names[0]}.weight"] = Target(f"{ours}.mlp.w13", (e, gate))
        out[f"{prefix}.{names[1]}.weight"] = Target(f"{ours}.mlp.w13", (e, up))
        out[f"{prefix}.{names[2]}.weight"] = Target(f"{ours}.mlp.w2", (e,))
    return out
