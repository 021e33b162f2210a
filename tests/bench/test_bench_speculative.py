"""A slice of bench/speculative_acceptance.py on the default model: each method's
greedy outputs equal no speculation and its counts add up."""

from __future__ import annotations

from bench.speculative_acceptance import main


def test_acceptance_on_the_default_model_slice(tmp_path):
    result = main(["--prompts", "3", "--max-tokens", "24", "--out", str(tmp_path / "r.json")])
    assert result["prompts"] == {"summary": 3, "code edit": 3}
    for method, rows in result["methods"].items():
        for kind in ("summary", "code edit"):
            row = rows[kind]
            assert row["equal_to_off"], (method, kind)
            assert 0 <= row["accepted_tokens"] <= row["draft_tokens"]
        assert sum(rows[k]["accepted_tokens"] for k in ("summary", "code edit")) > 0, method
    assert (tmp_path / "r.json").is_file()


def test_the_gpu_script_reports_where_outputs_with_drafts_differ(model_dir):
    """bench/gpu/speculative.py: an output with drafts that differs from its output
    without is reported with its first differing position and the gap there between
    the two likeliest tokens without drafts (here a made-up difference at token 3)."""
    from types import SimpleNamespace

    from bench.gpu.speculative import divergences, first_difference
    from engine import LLM, SamplingParams

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    folder = str(model_dir("tiny-llama"))
    prompt = [5, 9, 12, 7]
    llm = LLM(folder, dtype="float32", device="cpu")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                logprobs=2))[0].outputs[0]  # fmt: skip
    llm.close()
    off = list(out.token_ids)
    on = off[:3] + [off[3] + 1] + off[4:]
    rows = {"off": {"c": {"outputs": [off]}}, "ngram": {"c": {"outputs": [off]}},
            "trie": {"c": {"outputs": [on]}}}  # fmt: skip
    section = SimpleNamespace(cuda=False, device="cpu")
    found = divergences(section, folder, "auto", {"c": ([prompt], False)}, rows, "float32")
    assert list(found) == ["c"] and list(found["c"]) == ["trie"]
    [d] = found["c"]["trie"]
    ranked = sorted(v.logprob for v in out.logprobs[3].values())[::-1]
    assert (d["prompt"], d["position"], d["token"]) == (0, 3, off[3])
    assert abs(d["gap"] - (ranked[0] - ranked[1])) < 1e-5 and d["gap"] >= 0
    assert (
        divergences(
            section,
            folder,
            "auto",
            {"c": ([prompt], False)},
            {m: {"c": {"outputs": [off]}} for m in ("off", "ngram", "trie")},
            "float32",
        )
        == {}
    )
