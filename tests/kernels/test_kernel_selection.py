"""Dynamic kernel selection: the fastest candidate per shape bucket, tuned
once, remembered on disk per device and Triton version, shared between the
processes of a machine, and named in the debug log."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from kernels import selection
from kernels.selection import Candidate, Selector
from kernels.selection_verify import close_outputs


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("YINIAN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(selection, "_CACHES", {})
    return tmp_path


def wall_timer(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def make_selector(calls: list, timer=wall_timer) -> Selector:
    def slow(x, delay):
        calls.append(("slow", delay))
        time.sleep(delay)
        return x + 1

    def fast(x, scale):
        calls.append(("fast", scale))
        return x * scale + 1 - x * (scale - 1)

    def broken(x):
        raise RuntimeError("out of resources")

    return Selector(
        "toy",
        {"slow": slow, "broken": broken, "fast": fast},
        {"slow": [{"delay": 0.02}, {"delay": 0.01}], "fast": [{"scale": 1}]},
        bucket=lambda x: (selection.next_power_of_2(x.shape[0]), str(x.dtype)),
        timer=timer,
        tune_on_cpu=True,
    )


def test_tunes_once_per_bucket_and_remembers_on_disk(fresh_cache, caplog):
    calls: list = []
    sel = make_selector(calls)
    x = torch.ones(5)
    with caplog.at_level(logging.DEBUG, logger="yinian.kernels"):
        assert torch.equal(sel(x), x + 1)
    assert sel.choose(x) == Candidate("fast", (("scale", 1),))
    assert (
        "kernel toy on cpu bucket (8, 'torch.float32') -> fast {'scale': 1} (tuned" in caplog.text
    )
    files = list(fresh_cache.glob("cpu__triton-*.json"))
    assert len(files) == 1 and selection.triton_version() in files[0].name
    stored = json.loads(files[0].read_text())["toy"]["(8, 'torch.float32')"]
    assert stored["variant"] == "fast" and stored["config"] == {"scale": 1}
    tuned_calls = len(calls)
    sel(torch.ones(7))  # same bucket: no tuning
    assert len(calls) == tuned_calls + 1
    sel(torch.ones(9))  # new bucket: tuned again
    assert len(calls) > tuned_calls + 2


def test_a_new_process_uses_the_disk_cache(fresh_cache, caplog):
    make_selector([])(torch.ones(3))
    selection._CACHES.clear()  # as if another process started

    def no_timing(fn):
        raise AssertionError("must not tune: the choice is on disk")

    sel = make_selector([], timer=no_timing)
    with caplog.at_level(logging.DEBUG, logger="yinian.kernels"):
        sel(torch.ones(3))
    assert "(cached)" in caplog.text


def test_a_choice_another_process_made_meanwhile_wins(fresh_cache):
    sel = make_selector([])
    x = torch.ones(2)
    sel.choose(torch.ones(100))  # loads this process's view of the cache file
    path = next(fresh_cache.glob("cpu__*.json"))
    data = json.loads(path.read_text())
    data["toy"]["(2, 'torch.float32')"] = {"variant": "slow", "config": {"delay": 0.01}, "ms": 0.0}
    path.write_text(json.dumps(data))
    assert sel.choose(x) == Candidate("slow", (("delay", 0.01),))


def test_shipped_choices_spare_a_fresh_machine_the_tuning(fresh_cache, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(selection, "SHIPPED_DIR", shipped)
    bucket = "(4, 'torch.float32')"
    choice = {"variant": "slow", "config": {"delay": 0.01}, "ms": 0.5}
    (shipped / selection.cache_file_name("cpu")).write_text(json.dumps({"toy": {bucket: choice}}))

    def no_timing(fn):
        raise AssertionError("must not tune: the choice was shipped")

    assert make_selector([], timer=no_timing).choose(torch.ones(3)) == Candidate(
        "slow", (("delay", 0.01),)
    )
    # this machine's own choice comes first
    selection._CACHES.clear()
    own = {"toy": {bucket: {"variant": "fast", "config": {"scale": 1}, "ms": 0.1}}}
    (fresh_cache / selection.cache_file_name("cpu")).write_text(json.dumps(own))
    assert make_selector([], timer=no_timing).choose(torch.ones(3)).variant == "fast"
    # YINIAN_KERNEL_SHIPPED=0: tuned as without them
    selection._CACHES.clear()
    (fresh_cache / selection.cache_file_name("cpu")).unlink()
    monkeypatch.setenv("YINIAN_KERNEL_SHIPPED", "0")
    calls: list = []
    assert make_selector(calls).choose(torch.ones(3)).variant == "fast"
    assert ("slow", 0.01) in calls  # every candidate was timed


def test_every_shipped_choice_is_a_candidate_of_its_kernel():
    import importlib

    kernels = ("activation", "decode_attention", "extend_attention", "fused_moe", "grouped_topk",
               "mla_decode", "mla_rotary", "moe_routing", "norm", "rotary",
               "skinny_linear")  # fmt: skip
    for name in kernels:
        importlib.import_module(f"kernels.{name}")
    selectors = {s.cache_key: s for s in selection.SELECTORS}
    files = sorted(selection.SHIPPED_DIR.glob("*.json"))
    assert files, "kernels/tuned ships no choices"
    for path in files:
        for op, buckets in json.loads(path.read_text()).items():
            assert op in selectors, f"{path.name}: no kernel named {op} (a stale revision?)"
            for bucket, choice in buckets.items():
                candidate = Candidate.from_json(choice)
                assert candidate in selectors[op].candidates, (path.name, op, bucket, choice)


def test_on_cpu_without_tuning_the_first_candidate_is_used(caplog):
    calls: list = []
    sel = Selector(
        "plain", {"a": lambda x: x, "b": lambda x: -x}, {}, bucket=lambda x: (x.shape[0],)
    )
    with caplog.at_level(logging.DEBUG, logger="yinian.kernels"):
        out = sel(torch.ones(2))
    assert torch.equal(out, torch.ones(2)) and not calls
    assert "-> a {} (default)" in caplog.text


def rigged_timer(ranking: dict):
    """Reports the ms of whichever toy candidate ran: the ranking decides, not the clock."""
    last = []

    def timer(fn):
        last.append(fn())
        return ranking[round(float(last[-1][0]), 3)]

    return timer


def make_verified_selector(calls: list, timer, verify=True) -> Selector:
    """Three variants writing the same `out` buffer; "wrong" is the fastest and adds 0.1."""

    def good(x, out):
        calls.append("good")
        return torch.mul(x, 2, out=out)

    def also_good(x, out):
        calls.append("also_good")
        return torch.add(x, x, out=out)

    def wrong(x, out):
        calls.append("wrong")
        return torch.add(x * 2, 0.1, out=out)

    return Selector(
        "verified" if verify else "unverified",
        {"good": good, "wrong": wrong, "also_good": also_good},
        {},
        bucket=lambda x, out: (x.shape[0],),
        timer=timer,
        tune_on_cpu=True,
        verify=close_outputs({torch.float32: 1e-3}) if verify else None,
    )


def test_a_candidate_with_wrong_output_is_never_chosen(fresh_cache, caplog):
    x = torch.arange(6, dtype=torch.float32) + 1  # x[0] = 1: good -> 2, wrong -> 2.1
    timer = rigged_timer({2.0: 3.0, 2.1: 1.0})  # wrong is the fastest
    calls: list = []
    sel = make_verified_selector(calls, timer)
    with caplog.at_level(logging.DEBUG, logger="yinian.kernels"):
        out = sel(x, torch.empty(6))
    assert torch.equal(out, x * 2)
    assert sel.choose(x, torch.empty(6)).variant in ("good", "also_good")
    assert "candidate wrong {} disagrees with good {}" in caplog.text
    assert "dropped" in caplog.text
    assert calls.count("wrong") == 1  # run once for the check, never timed
    report: dict = {}
    best, _ = sel.tune((x, torch.empty(6)), report=report)
    assert best.variant != "wrong"
    assert report[Candidate("wrong")].startswith("wrong output: output 0 element 0: 2.1 vs 2")
    # The same selector without the check picks the fast wrong kernel: the check is what
    # protects, and operators that do not opt in keep the old behaviour.
    unchecked = make_verified_selector([], rigged_timer({2.0: 3.0, 2.1: 1.0}), verify=False)
    assert unchecked.choose(x, torch.empty(6)).variant == "wrong"


def test_the_reference_is_the_first_candidate_that_runs():
    """A first candidate that raises is dropped; the next one becomes the reference."""

    def broken(x):
        raise RuntimeError("out of resources")

    sel = Selector(
        "ref",
        {"broken": broken, "a": lambda x: x + 1, "b": lambda x: x + 2},
        {},
        bucket=lambda x: (x.shape[0],),
        timer=wall_timer,
        tune_on_cpu=True,
        verify=close_outputs({}),
    )
    report: dict = {}
    best, _ = sel.tune((torch.ones(3),), report=report)
    assert best == Candidate("a")
    assert report[Candidate("broken")].startswith("failed: RuntimeError")
    assert report[Candidate("b")].startswith("wrong output")


def test_close_outputs():
    verify = close_outputs({torch.bfloat16: 2e-2}, default=1e-3)
    ref = torch.tensor([1.0, -3.0, float("nan"), float("inf")])
    assert verify(ref, ref.clone()) is None  # NaN where the reference has NaN; inf == inf
    assert verify(ref, ref + torch.tensor([5e-4, 0, 0, 0])) is None
    assert "element 0" in verify(ref, ref + torch.tensor([5e-3, 0, 0, 0]))
    assert "element 1" in verify(ref, torch.tensor([1.0, float("nan"), float("nan"), 1.0]))
    assert "torch.float16" in verify(ref, ref.half())
    bf = torch.randn(1000).bfloat16()
    assert verify(bf, bf * 1.01) is None and verify(bf, bf * 1.1) is not None
    assert verify((ref, ref), (ref, ref[:2])) is not None
    chunked = close_outputs({}, chunk=7)
    big = torch.randn(100)
    wrong = big.clone()
    wrong[93] += 1
    assert "element 93" in chunked(big, wrong)


def test_unsupported_variants_are_neither_tuned_nor_chosen(fresh_cache):
    calls: list = []

    def gpu_only(x):
        calls.append("gpu_only")
        return x

    sel = Selector(
        "gated",
        {"portable": lambda x: x, "gpu_only": gpu_only},
        {},
        bucket=lambda x: (x.shape[0],),
        timer=lambda fn: 0.0 if fn() is None else 1.0,
        tune_on_cpu=True,
        supported={"gpu_only": lambda device: device.type == "cuda"},
    )
    assert sel.choose(torch.ones(2)) == Candidate("portable") and not calls
    assert [c.variant for c in sel.usable(torch.device("cpu"))] == ["portable"]
    # A choice on disk that this device cannot run is not taken: it is tuned again.
    path = next(fresh_cache.glob("cpu__*.json"))
    data = json.loads(path.read_text())
    data["gated"]["(3,)"] = {"variant": "gpu_only", "config": {}, "ms": 0.0}
    path.write_text(json.dumps(data))
    selection._CACHES.clear()
    assert sel.choose(torch.ones(3)) == Candidate("portable") and not calls


def test_configs_that_do_not_suit_the_inputs_are_neither_tuned_nor_chosen(fresh_cache):
    timed: list = []

    def tiled(x, tile):
        timed.append(tile)
        return x * 1

    def timer(fn):
        fn()
        return 1.0 / timed[-1]  # wider tiles time faster: the widest that suits wins

    sel = Selector(
        "tiles", {"tiled": tiled}, {"tiled": [{"tile": 1}, {"tile": 4}, {"tile": 8}]},
        bucket=lambda x: (x.shape[0],), timer=timer, tune_on_cpu=True,
        applies=lambda config, x: config["tile"] <= x.shape[0],
    )  # fmt: skip
    assert sel.choose(torch.ones(5)) == Candidate("tiled", (("tile", 4),))
    assert timed == [1, 4]  # the 8-wide tile was never run on 5 rows
    assert sel.choose(torch.ones(9)) == Candidate("tiled", (("tile", 8),))
    # a choice on disk that does not suit its bucket's inputs is tuned again
    path = next(fresh_cache.glob("cpu__*.json"))
    data = json.loads(path.read_text())
    data["tiles"]["(2,)"] = {"variant": "tiled", "config": {"tile": 8}, "ms": 0.0}
    path.write_text(json.dumps(data))
    selection._CACHES.clear()
    timed.clear()
    assert sel.choose(torch.ones(2)) == Candidate("tiled", (("tile", 1),)) and timed == [1]


def test_a_rule_of_one_variant_leaves_the_others_suiting_every_input(fresh_cache):
    timed: list = []

    def narrow(x, tile):
        timed.append(("narrow", tile))
        return x * 1

    def wide(x):
        timed.append(("wide",))
        return x * 1

    sel = Selector(
        "rules", {"narrow": narrow, "wide": wide}, {"narrow": [{"tile": 2}, {"tile": 4}]},
        bucket=lambda x: (x.shape[0],), timer=lambda fn: [fn(), 1.0][1], tune_on_cpu=True,
        applies={"narrow": lambda config, x: config["tile"] <= x.shape[0]},
    )  # fmt: skip
    sel.choose(torch.ones(3))
    assert timed == [("narrow", 2), ("wide",)]  # the 4-wide tile does not suit 3 rows


def test_tuning_runs_on_the_inputs_tune_args_gives(fresh_cache):
    # An operator that adds into an argument: tuning runs every candidate (several times),
    # the caller's counter must see one call's worth.
    def add(x, counter, step):
        counter += step
        return x

    sel = Selector(
        "adds", {"add": add}, {"add": [{"step": 1}, {"step": 2}]},
        bucket=lambda x, counter: (x.shape[0],), timer=wall_timer, tune_on_cpu=True,
        tune_args=lambda args: (args[0], torch.zeros_like(args[1])),
    )  # fmt: skip
    counter = torch.zeros(1)
    sel(torch.ones(3), counter)
    chosen = sel.choose(torch.ones(3), counter).kwargs["step"]
    assert counter.item() == chosen  # only the chosen candidate's one call counted
    sel(torch.ones(3), counter)
    assert counter.item() == 2 * chosen


def test_a_revision_makes_choices_on_disk_again(fresh_cache):
    make_selector([])(torch.ones(3))
    selection._CACHES.clear()

    def counting_timer(fn):
        counting_timer.calls += 1
        return wall_timer(fn)

    counting_timer.calls = 0
    sel = make_selector([], timer=counting_timer)
    sel(torch.ones(3))
    assert counting_timer.calls == 0  # same op, no revision: the disk choice stands
    revised = Selector(
        "toy", sel.variants, {"slow": [{"delay": 0.0}], "fast": [{"scale": 1}]},
        bucket=sel.bucket, timer=counting_timer, tune_on_cpu=True, revision="2",
    )  # fmt: skip
    revised(torch.ones(3))
    assert counting_timer.calls > 0
    stored = json.loads(next(fresh_cache.glob("cpu__*.json")).read_text())
    assert set(stored) == {"toy", "toy@2"}


def test_extend_attention_variants_are_checked_against_the_pointer_kernel(fresh_cache, caplog):
    """The real extend kernels under the interpreter: the TMA variant's output passes the
    check against the pointer kernel's; a fast kernel with a wrong scale is dropped."""
    from attention_batches import CAPABILITY, MIXED, SCALE, make_batch

    from kernels.extend_attention import flash_extend, tma_extend
    from kernels.selection_verify import ATTENTION_TOLERANCE

    if CAPABILITY is not None and CAPABILITY < (9, 0):
        pytest.skip("TMA needs sm_90 or newer")

    ran: list = []

    def named(name, fn):
        def run(*args, **config):
            ran.append(name)
            return fn(*args, **config)

        return run

    def wrong_scale(*args, **config):
        args = (*args[:8], args[8] * 1.5, args[9])
        return flash_extend(*args, **config)

    config = [dict(block_m=16, block_n=16, num_warps=4, num_stages=2)]
    sel = Selector(
        "extend_check",
        {"flash": named("flash", flash_extend), "tma": named("tma", tma_extend),
         "bad": named("bad", wrong_scale)},
        {"flash": config, "tma": config, "bad": config},
        bucket=lambda *args: (args[0].shape[0],),
        timer=lambda fn: (fn(), {"flash": 3.0, "tma": 2.0, "bad": 1.0}[ran[-1]])[1],
        tune_on_cpu=True,
        verify=close_outputs(ATTENTION_TOLERANCE),
    )  # fmt: skip
    query_lens, seq_lens = MIXED
    b = make_batch(query_lens, seq_lens, 2, 2, 16, 8, torch.bfloat16)
    args = (
        b["q"], b["k"], b["v"], b["cache"], b["block_tables"], b["query_start_loc"],
        b["seq_lens"], max(query_lens), SCALE, torch.empty_like(b["q"]),
    )  # fmt: skip
    report: dict = {}
    with caplog.at_level(logging.WARNING, logger="yinian.kernels"):
        best, ms = sel.tune(args, report=report)
    assert best.variant == "tma" and ms == 2.0
    assert isinstance(report[best], float)
    assert report[Candidate("bad", tuple(sorted(config[0].items())))].startswith("wrong output")
    assert "candidate bad" in caplog.text and "candidate tma" not in caplog.text


def test_a_candidate_may_call_an_operator_that_is_not_tuned_yet(fresh_cache):
    """A MoE candidate runs a shared expert's SiLU, itself tuned on first use: tuning
    it inside the outer tuning must not wait on the lock its own process holds (a
    fresh machine's worker hung there for minutes, until it was killed)."""
    import threading

    rows = dict(bucket=lambda x: (x.shape[0],), timer=wall_timer, tune_on_cpu=True)
    inner = Selector("inner", {"a": lambda x, k: x + k}, {"a": [{"k": 1}, {"k": 1.0}]}, **rows)
    outer = Selector(
        "outer", {"b": lambda x, s: inner(x) * s}, {"b": [{"s": 2}, {"s": 2.0}]}, **rows
    )
    got = []
    worker = threading.Thread(target=lambda: got.append(outer(torch.ones(3))), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "tuning waited on its own lock"
    assert torch.equal(got[0], torch.full((3,), 4.0))
    stored = json.loads(next(fresh_cache.glob("cpu__*.json")).read_text())
    assert set(stored) >= {"inner", "outer"}  # both tuned, both remembered
