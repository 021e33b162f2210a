"""DeepSeek (MLA: the KV cache is one compressed latent per token) through the split
mesh: a prefill worker computes the prompt and hands its latent blocks to a decode
worker over tcp; the answers equal the engine's, every prompt's blocks were moved,
and no handoff fell back to a local prefill."""

from __future__ import annotations

import httpx
import pytest
from prompts import random_prompts

from engine import LLM, SamplingParams
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import metric_sum

MODELS = ("tiny-deepseek-v2", "tiny-deepseek-v3")


@pytest.mark.parametrize("name", MODELS)
def test_split_mesh_equals_engine_for_deepseek(model_dir, name):
    model = str(model_dir(name))
    prompts = random_prompts(500, (1, 17, 70, 300), seed=95)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(model, device="cpu")
    try:
        expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    spec = MeshSpec(
        model=model, workers=0, prefill=1, decode=1, port=0, kvstore=False,
        engine_argv=["--device", "cpu"], scheduler_argv=["--disagg-min-tokens", "1"],
    )  # fmt: skip
    with Mesh(spec) as mesh:
        for prompt, want in zip(prompts, expected):
            body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            resp = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == want, len(prompt)
        moved = metric_sum(mesh, "yinian:kv_transfer_blocks_total")
        assert moved == sum(-(-len(p) // 16) for p in prompts)  # every prompt handed over
        assert metric_sum(mesh, "yinian:kv_handoff_fallbacks_total") == 0
