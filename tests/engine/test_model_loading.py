"""Model folders: presets, sharded checkpoints, dummy weights, dtypes, and a
clear error for everything the engine cannot load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from basis.model_config import ModelConfig
from basis.tokenizer import Tokenizer
from engine import LLM, SamplingParams
from engine import make_model as mm
from engine.models.hf_names import hf_weight_targets

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("preset", mm.TINY_PRESETS)
def test_tiny_preset_tokenizer_loads_everywhere(preset, model_dir):
    from transformers import AutoTokenizer

    folder = model_dir(preset)
    ours = Tokenizer.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    text = "Hello, world! 你好 🙂"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size < 8 * 1024 * 1024  # "a few MB"


@pytest.mark.parametrize(
    ("preset", "params_b", "checks"),
    [
        (
            "llama3-8b",
            8.03,
            {
                "model.layers.31.self_attn.k_proj.weight": (1024, 4096),
                "model.layers.0.mlp.gate_proj.weight": (14336, 4096),
                "lm_head.weight": (128256, 4096),
            },
        ),
        (
            "qwen3-30b-a3b",
            30.53,
            {
                "model.layers.47.mlp.experts.127.down_proj.weight": (2048, 768),
                "model.layers.0.mlp.gate.weight": (128, 2048),
                "model.layers.5.self_attn.q_norm.weight": (128,),
                "model.layers.0.self_attn.q_proj.weight": (4096, 2048),
            },
        ),
    ],
)
def test_full_size_preset_configs(preset, params_b, checks, tmp_path):
    from transformers import AutoConfig

    folder = mm.write_model(tmp_path / preset, mm.preset_config(preset), weights=False)
    assert not list(folder.glob("*.safetensors"))
    config = ModelConfig.from_pretrained(folder)
    assert config.num_parameters() / 1e9 == pytest.approx(params_b, abs=0.01)
    shapes = mm._target_shapes(config, hf_weight_targets(config))
    for name, shape in checks.items():
        assert shapes[name] == shape
    hf_config = AutoConfig.from_pretrained(folder)
    assert hf_config.num_hidden_layers == config.num_hidden_layers
    assert Tokenizer.from_pretrained(folder).vocab_size == config.vocab_size
    with pytest.raises(ValueError, match="dummy"):
        LLM(folder, device="cpu")


def test_dummy_weights_need_no_file(tmp_path):
    folder = mm.write_model(tmp_path / "m", mm.preset_config("tiny-moe"), weights=False)
    llm = LLM(folder, device="cpu", load_format="dummy", seed=3)
    again = LLM(folder, device="cpu", load_format="dummy", seed=3)
    a = llm.generate(["hello"], GREEDY)[0].outputs[0].token_ids
    assert a == again.generate(["hello"], GREEDY)[0].outputs[0].token_ids
    assert len(a) == 8


def test_sharded_checkpoint(tmp_path, model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(mm, "SHARD_BYTES", 200_000)
    folder = mm.write_model(tmp_path / "sharded", mm.preset_config("tiny-qwen3"), seed=1)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    single = LLM(model_dir("tiny-qwen3"), device="cpu").generate([[1, 2, 3]], GREEDY)
    sharded = LLM(folder, device="cpu").generate([[1, 2, 3]], GREEDY)
    assert single[0].outputs[0].token_ids == sharded[0].outputs[0].token_ids
    AutoModelForCausalLM.from_pretrained(folder)


def _copy(model_dir, tmp_path, name="tiny-llama"):
    folder = tmp_path / name
    shutil.copytree(model_dir(name), folder)
    return folder


def _edit_weights(folder, edit):
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_missing_tensor_is_named(model_dir, tmp_path):
    folder = _copy(model_dir, tmp_path)
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(folder, device="cpu")


def test_mismatched_tensor_is_named(model_dir, tmp_path):
    folder = _copy(model_dir, tmp_path)
    _edit_weights(folder, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(65,\).*\(64,\)"):
        LLM(folder, device="cpu")


def test_unexpected_tensor_is_named(model_dir, tmp_path):
    folder = _copy(model_dir, tmp_path)
    _edit_weights(folder, lambda t: t.update({"model.layers.9.foo.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"model\.layers\.9\.foo\.weight"):
        LLM(folder, device="cpu")


def test_unsupported_architecture(model_dir, tmp_path):
    folder = _copy(model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(folder, device="cpu")


def test_folder_without_tokenizer_serves_token_ids(model_dir, tmp_path):
    folder = _copy(model_dir, tmp_path)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    llm = LLM(folder, device="cpu")
    expected = LLM(model_dir("tiny-llama"), device="cpu").generate([[4, 5, 6]], GREEDY)
    out = llm.generate([[4, 5, 6]], GREEDY)[0].outputs[0]
    assert out.token_ids == expected[0].outputs[0].token_ids and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["some text"], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([[4, 5, 6]], SamplingParams(stop=["x"]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(model_dir, dtype):
    from prompts import engine_logits

    full = LLM(model_dir("tiny-qwen3"), dtype="float32", device="cpu")
    half = LLM(model_dir("tiny-qwen3"), dtype=dtype, device="cpu")
    assert half.engine.runner.kv_caches[0].dtype == getattr(torch, dtype)
    prompt = list(range(3, 40))
    ref = engine_logits(full.engine, prompt, 2)
    got = engine_logits(half.engine, prompt, 2)
    for g, r in zip(got, ref):
        assert (g - r).abs().max() < 0.15 * r.abs().max()
