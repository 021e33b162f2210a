"""The GPU scripts' section runner: a failing section costs only itself, skips carry
their reason, the JSON on disk is current after every section, and a shared resource
is made once, its failure reported in every section that needs it, and closed."""

from __future__ import annotations

import json

import pytest

from bench.gpu.sections import Sections, outcome, script_parser


def run(tmp_path, *argv):
    args = script_parser("test").parse_args(["--out", str(tmp_path / "r.json"), *argv])
    return Sections(args, script="test")


def test_sections_are_isolated_timed_and_saved_as_they_go(tmp_path):
    seen = {}
    with run(tmp_path, "--skip", "skipped", "--device", "cpu") as section:
        assert section("first", lambda: {"value": 1}) == {"value": 1}
        seen["after first"] = json.loads((tmp_path / "r.json").read_text())
        assert section("broken", lambda: 1 / 0) is None
        section("skipped", lambda: pytest.fail("a skipped section ran"))
        section("graphs", lambda: pytest.fail("ran without CUDA"), needs="CUDA graphs")
        section("last", lambda: [2])
    results = json.loads((tmp_path / "r.json").read_text())
    assert seen["after first"]["first"] == {"value": 1}
    assert list(results["seconds"]) == ["first", "broken", "skipped", "graphs", "last"]
    assert {n: outcome(results[n]) for n in results["seconds"]} == {
        "first": "ok", "broken": "error", "skipped": "skipped", "graphs": "skipped", "last": "ok",
    }  # fmt: skip
    assert "ZeroDivisionError" in results["broken"]["error"]
    assert results["skipped"] == {"skipped": "skipped on the command line"}
    assert results["graphs"]["skipped"].startswith("needs CUDA graphs; this is a dry run")
    assert results["device"] == "cpu" and results["script"] == "test"


def test_a_resource_is_made_once_and_closed(tmp_path):
    made, closed = [], []
    with run(tmp_path, "--device", "cpu") as section:
        engine = section.resource(lambda: made.append(1) or "engine", closed.append)
        section("a", lambda: engine())
        section("b", lambda: engine())
    assert made == [1] and closed == ["engine"]


def test_a_resource_that_fails_fails_each_section_that_needs_it(tmp_path):
    attempts = []

    def make():
        attempts.append(1)
        raise OSError("no mesh")

    with run(tmp_path, "--device", "cpu") as section:
        mesh = section.resource(make, lambda m: pytest.fail("closed what was never made"))
        section("a", lambda: mesh())
        section("b", lambda: mesh())
        section("c", lambda: "independent")
    results = json.loads((tmp_path / "r.json").read_text())
    assert attempts == [1]
    assert "no mesh" in results["a"]["error"] and "no mesh" in results["b"]["error"]
    assert results["c"] == "independent"


def test_calls_that_split_a_script_merge_into_the_file_one_call_would_write(tmp_path):
    from bench.merge_sections import main as merge_main

    def call(name, skip, **sections):
        with run(tmp_path, "--device", "cpu", "--out", str(tmp_path / name), "--skip", *skip) as s:
            for section, fn in sections.items():
                s(section, fn)
        return tmp_path / name

    first = call("a.json", ["workload"], ceilings=lambda: {"gbps": 1}, tier=lambda: 1 / 0,
                 workload=lambda: pytest.fail("skipped"))  # fmt: skip
    second = call("b.json", [], ceilings=lambda: {"gbps": 2}, tier=lambda: {"ms": 3},
                  workload=lambda: {"on": 4})  # fmt: skip
    merged = merge_main([str(first), str(second), "--out", str(tmp_path / "m.json")])
    assert merged == json.loads((tmp_path / "m.json").read_text())
    # the first call's ceilings stand; the second call's run replaces the first's error
    assert (merged["ceilings"], merged["tier"], merged["workload"]) == ({"gbps": 1}, {"ms": 3},
                                                                        {"on": 4})  # fmt: skip
    assert merged["calls"] == {"a.json": ["ceilings"], "b.json": ["tier", "workload"]}
    assert merged["repeated"] == {"ceilings": ["b.json"]}
    assert set(merged["seconds"]) == {"ceilings", "tier", "workload"}
    other = json.loads(second.read_text()) | {"script": "other"}
    (tmp_path / "c.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="script 'other'"):
        merge_main([str(first), str(tmp_path / "c.json"), "--out", str(tmp_path / "x.json")])


def test_step_profile_names_the_host_operators_that_took_the_time(capsys):
    import torch

    from bench.gpu.step_profile import print_compared, profiled

    a = torch.randn(256, 256)

    def run(n: int):
        return lambda: [a @ a for _ in range(n)]

    many, few = profiled(run(40), steps=4, cuda=False), profiled(run(4), steps=4, cuda=False)
    assert "kernel_ms_per_step" not in many  # no device here
    assert many["host_ms_per_step"]["aten::mm"] > 3 * few["host_ms_per_step"]["aten::mm"]
    print_compared("many", many, few, "few")
    assert "aten::mm" in capsys.readouterr().out
