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


def test_on_cpu_without_tuning_the_first_candidate_is_used(caplog):
    calls: list = []
    sel = Selector(
        "plain", {"a": lambda x: x, "b": lambda x: -x}, {}, bucket=lambda x: (x.shape[0],)
    )
    with caplog.at_level(logging.DEBUG, logger="yinian.kernels"):
        out = sel(torch.ones(2))
    assert torch.equal(out, torch.ones(2)) and not calls
    assert "-> a {} (default)" in caplog.text
