"""Speculative decoding through `yinian up`'s mesh: the engine flags reach the
worker, greedy text equals the engine's without speculation, and the worker's
metrics count the drafts it verified and kept."""

from __future__ import annotations

import json
import time

import httpx
from prompts import greedy_texts, quoting_prompts

from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import worker_metric


def test_mesh_with_drafts_serves_the_same_text(model_dir):
    folder = model_dir("tiny-llama")
    prompts = quoting_prompts(500, count=3, seed=21)
    expected = greedy_texts(folder, prompts, 40)
    argv = ["--device", "cpu", "--dtype", "float32", "--speculative-method", "ngram",
            "--prompt-lookup-min", "1", "--num-speculative-tokens", "3"]  # fmt: skip
    spec = MeshSpec(model=str(folder), workers=1, port=0, engine_argv=argv)
    with Mesh(spec) as mesh:
        for prompt, text in zip(prompts, expected):
            body = {"model": folder.name, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
        # streamed: several tokens a step arrive as one chunk; text and count add up
        body |= {"prompt": prompts[0], "stream": True, "stream_options": {"include_usage": True}}
        parts, usage = [], None
        with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    parts += [c["text"] for c in chunk["choices"]]
                    usage = chunk.get("usage") or usage
        assert "".join(parts) == expected[0] and usage["completion_tokens"] == 40

        def tokens(kind: str) -> float:
            return sum(worker_metric(mesh, "yinian:spec_decode_tokens", where=f'kind="{kind}"')
                       .values())  # fmt: skip

        deadline = time.monotonic() + 10  # the worker reports its load every half second
        while tokens("accepted") == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert 0 < tokens("accepted") < tokens("draft")
        rates = worker_metric(mesh, "yinian:spec_decode_acceptance", where='position="0"')
        assert 0 < sum(rates.values()) <= 1
