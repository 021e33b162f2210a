"""guidellm's report read as our sweep's rows (a real report of a CPU run, cut to
the fields read), a run whose arrivals lost their start told apart, and the
figures put beside ours."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from bench import serving_offered
from bench.loadgen import guidellm_run

REPORT = json.loads((Path(__file__).parent / "data" / "guidellm_report.json").read_text())


def test_a_report_becomes_a_sweep_row_with_our_keys():
    (row,) = guidellm_run.rows_of(REPORT)
    bench = REPORT["benchmarks"][0]
    timings = [r["info"]["timings"] for r in bench["requests"]["successful"]]
    span = max(t["request_end"] for t in timings) - min(t["request_start"] for t in timings)
    assert row["request_rate"] == 8.0 and row["completed"] == 64 and row["failed"] == 0
    assert row["request_throughput"] == pytest.approx(64 / span)
    starts = [t["request_start"] for t in timings]
    assert row["offered_rate"] == pytest.approx(63 / (max(starts) - min(starts)))
    assert 7.0 < row["offered_rate"] < 10.0  # what it sent, near the 8 a second it was asked
    assert row["output_throughput"] == pytest.approx(64 * 8 / span)  # 8 tokens a request
    ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]
    assert row["median_ttft_ms"] == ttft["median"]
    assert row["p99_ttft_ms"] == ttft["percentiles"]["p99"]
    itl = bench["metrics"]["inter_token_latency_ms"]["successful"]
    assert (row["median_tpot_ms"], row["p99_tpot_ms"]) == (itl["median"], itl["percentiles"]["p99"])
    assert row["median_prompt_tokens"] == 32 and row["worker_processes"] == 1
    assert guidellm_run.within_slo(row)
    assert not guidellm_run.within_slo(row | {"p99_ttft_ms": 201.0})
    assert not guidellm_run.within_slo(row | {"failed": 1})


def test_arrivals_timed_from_zero_are_not_a_run_at_the_rate():
    assert guidellm_run.on_schedule(REPORT)
    broken = copy.deepcopy(REPORT)
    bench = broken["benchmarks"][0]
    first = min(r["info"]["timings"]["targeted_start"] for r in bench["requests"]["successful"])
    for r in bench["requests"]["successful"]:  # as guidellm wrote them when it lost the start
        r["info"]["timings"]["targeted_start"] -= first
    assert not guidellm_run.on_schedule(broken)


def test_each_figure_beside_ours():
    (theirs,) = guidellm_run.rows_of(REPORT)
    ours = {k: theirs[k] for k in ("request_rate", "completed", "failed", "offered_rate")} | {
        "output_throughput": theirs["output_throughput"] / 1.05,
        "median_ttft_ms": theirs["median_ttft_ms"],
        "p99_ttft_ms": theirs["p99_ttft_ms"] / 0.8,  # ours 25% higher
        "median_tpot_ms": theirs["median_tpot_ms"],
        "p99_tpot_ms": theirs["p99_tpot_ms"],
    }
    (agreed,) = guidellm_run.agreement([ours, ours | {"request_rate": math.inf}], [theirs])
    ratios = agreed["ratio_theirs_to_ours"]
    assert ratios["output_throughput"] == pytest.approx(1.05)
    assert ratios["p99_ttft_ms"] == pytest.approx(0.8)
    assert not agreed["all_within_10pct"]
    assert agreed["ours_within_slo"] and agreed["theirs_within_slo"]
    # the same figures from a heavier load than ours are no agreement either
    (heavier,) = guidellm_run.agreement([theirs | {"offered_rate": theirs["offered_rate"] / 1.2}],
                                        [theirs])  # fmt: skip
    assert heavier["ratio_theirs_to_ours"]["offered_rate"] == pytest.approx(1.2)
    assert not heavier["all_within_10pct"]
    (same,) = guidellm_run.agreement([theirs], [theirs])
    assert same["all_within_10pct"]


def test_a_rate_guidellm_cannot_send_is_refused():
    for rate in (math.inf, 0.0):
        with pytest.raises(ValueError, match="finite positive rate"):
            guidellm_run.command("http://x", "m", "tok", rate, 10, 32, 8, Path("r.json"))


def test_the_rates_two_clients_offered_in_a_committed_sweep(capsys):
    # stop 82's H100 sweep: one seed's draw made our schedule 0.88 of each rate named
    results = Path(__file__).parents[2] / "bench" / "results"
    serving_offered.main([str(results / "serving_s82_h100.json"),
                          str(results / "serving_s82_h100_sweep.tgz"),
                          str(results / "serving_s82_h100_guidellm.tgz")])  # fmt: skip
    rows = [line.split("|")[1:4] for line in capsys.readouterr().out.splitlines()[2:]]
    sent = {float(named): (float(ours), float(theirs)) for named, ours, theirs in rows}
    assert sent[24.0] == (21.2, 26.3) and sent[32.0] == (28.2, 31.7)
    assert all(ours / named < 0.9 for named, (ours, _) in sent.items())
