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
