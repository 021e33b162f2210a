"""DeepSeek-V2/V3 checkpoints in the engine: the latent KV cache's size, the
full-size V2-Lite preset, the MTP layer of V3 checkpoints, the float32 router
in a 16-bit model, and clear errors for configs the engine cannot compute.
(Logits and greedy outputs against transformers: test_hf_parity.py; scheduling
equivalences: test_engine_equivalence.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from basis.model_config import ModelConfig
from engine import LLM, SamplingParams
from engine import make_model as mm
from engine.kv_cache_spec import KVCacheSpec
from engine.models.hf_names import hf_weight_targets

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def kv_bytes_per_token(preset: str) -> int:
    config = ModelConfig.from_dict(mm.preset_config(preset))
    return KVCacheSpec.for_model(config, 16, torch.bfloat16).bytes_per_token


def test_latent_cache_is_a_quarter_of_llama3_8b():
    """MLA keeps 512 + 64 values per token and layer: V2-Lite's 27 layers take 31,104
    bytes a token in bf16, Llama-3-8B's grouped K/V (32 layers x 2 x 8 heads x 128)
    131,072: 4.2x more context in the same memory."""
    lite, llama = kv_bytes_per_token("deepseek-v2-lite"), kv_bytes_per_token("llama3-8b")
    ratio = llama / lite
    print(f"KV bytes/token: deepseek-v2-lite {lite}, llama3-8b {llama}, ratio {ratio:.2f}")
    assert (lite, llama) == (27 * 576 * 2, 32 * 2 * 8 * 128 * 2)
    assert ratio == pytest.approx(4.21, abs=0.01)


def test_engine_allocates_the_latent_cache(model_dir):
    llm = LLM(model_dir("tiny-deepseek-v2"), device="cpu", num_gpu_blocks=10)
    caches = llm.engine.runner.kv_caches
    assert len(caches) == 3 and caches[0].shape == (10, 1, 16, 1, 32 + 8)
    assert caches[0].is_contiguous()  # block-major: a block of a layer is one piece


def test_deepseek_v2_lite_preset(tmp_path):
    from transformers import AutoConfig

    folder = mm.write_model(tmp_path / "lite", mm.preset_config("deepseek-v2-lite"), weights=False)
    config = ModelConfig.from_pretrained(folder)
    assert config.num_parameters() / 1e9 == pytest.approx(15.71, abs=0.01)
    assert config.active_parameters() / 1e9 == pytest.approx(2.45, abs=0.01)
    # (128 + 64)^-0.5 x mscale(40, 0.707)^2 = x1.590: yarn's softmax factor.
    assert config.attention_scale * 192**0.5 == pytest.approx(1.590, abs=1e-3)
    shapes = mm._target_shapes(config, hf_weight_targets(config))
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (16 * 192, 2048)
    assert shapes["model.layers.26.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2048)
    assert shapes["model.layers.26.self_attn.kv_b_proj.weight"] == (16 * 256, 512)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (10944, 2048)
    assert shapes["model.layers.1.mlp.experts.63.down_proj.weight"] == (2048, 1408)
    assert shapes["model.layers.1.mlp.shared_experts.up_proj.weight"] == (2816, 2048)
    assert AutoConfig.from_pretrained(folder).kv_lora_rank == 512
    with pytest.raises(ValueError, match="dummy"):
        LLM(folder, device="cpu")


def test_v3_attention_scale():
    cfg = dict(mm.preset_config("tiny-deepseek-v3"), rope_scaling={
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0,
    })  # fmt: skip
    assert ModelConfig.from_dict(cfg).attention_scale * 24**0.5 == pytest.approx(1.874, abs=1e-3)


def test_mtp_layer_of_v3_checkpoints_is_skipped(model_dir, tmp_path):
    """V3 checkpoints carry a multi-token-prediction layer as layer num_hidden_layers."""
    folder = tmp_path / "v3-mtp"
    shutil.copytree(model_dir("tiny-deepseek-v3"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    last = [k for k in tensors if k.startswith("model.layers.2.")]
    mtp = {k.replace("layers.2.", "layers.3."): tensors[k].clone() for k in last}
    mtp["model.layers.3.eh_proj.weight"] = torch.ones(64, 128)
    mtp["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"))
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    expected = LLM(model_dir("tiny-deepseek-v3"), device="cpu").generate(prompt, GREEDY)
    got = LLM(folder, device="cpu").generate(prompt, GREEDY)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_router_stays_float32_in_a_bfloat16_model(model_dir):
    from prompts import engine_logits

    full = LLM(model_dir("tiny-deepseek-v3"), dtype="float32", device="cpu")
    half = LLM(model_dir("tiny-deepseek-v3"), dtype="bfloat16", device="cpu")
    moe = half.engine.runner.model.layers[1].mlp
    assert moe.gate.dtype == moe.e_score_correction_bias.dtype == torch.float32
    assert moe.w13.dtype == half.engine.runner.kv_caches[0].dtype == torch.bfloat16
    prompt = list(range(3, 40))
    got = torch.cat(engine_logits(half.engine, prompt, 2))
    want = torch.cat(engine_logits(full.engine, prompt, 2))
    close = (got - want).abs().amax(-1) < 0.1 * want.abs().max()
    # bf16 rounding may flip a near-tied routing choice, changing a position's logits.
    assert close.float().mean() >= 0.9


@pytest.mark.parametrize(
    "edit,message",
    [
        (dict(scoring_func="softmax"), "V3 routing is sigmoid"),
        (dict(n_group=3), "n_group=3 must divide"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
        (dict(kv_lora_rank=None), "kv_lora_rank"),
        (dict(qk_rope_head_dim=7), "even"),
        (dict(attention_bias=True), "biases"),
        (dict(rope_scaling={"type": "yarn"}), "lacks 'factor'"),
    ],
)
def test_unsupported_deepseek_configs_are_refused(edit, message, model_dir, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(model_dir("tiny-deepseek-v3"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, **edit)))
    with pytest.raises(ValueError, match=message):
        LLM(folder, device="cpu")
