"""`yinian bench serve`: the load driver for OpenAI-compatible servers.

Requests are sent on a seeded arrival schedule (a trace's requests at their own
times, whatever the rate): all at once for rate inf,
else gaps drawn from a gamma distribution with shape `burstiness` and mean
1/rate (burstiness 1 is a Poisson process; < 1 burstier, > 1 steadier), as
in vLLM, scaled so that the run offers the rate it names (`arrival_offsets`);
each result reports the rate its sends kept (`offered_rate`); a sweep's rate i
draws its arrivals from seed + i (`arrival_seed`). `max_concurrency`
caps requests in flight with a semaphore. A multi-turn request waits for its
conversation's previous turn to finish; `max_active_conversations` caps the
conversations under way (one starts when one has sent its last turn), so that
its users come back while their history is fresh, instead of every user's first
turn before any second turn. With
conversations the schedule paces sends, not list positions: a turn that is
ready (its previous turn done, its conversation under way) takes the
schedule's next free time, so at rate R turns go out at R a second in the
order they become ready (tied to positions, a user's second turn would wait
for every first turn's time to pass).
A sweep repeats the run at each rate of `request_rates`, each on its own list
of requests.

Each run writes RESULT.json (metrics, config, per-request arrays with error
bodies) and RESULT-cdf.png; a sweep also writes BASE-sweep.json and the
latency/throughput-vs-rate plots.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from bench.loadgen.client import RequestInput, RequestResult, list_models, make_client, send_request
from bench.loadgen.datasets import BenchRequest
from bench.loadgen.metrics import compute_metrics, latency_samples, per_request
from bench.loadgen.plots import plot_cdfs, plot_sweep
from bench.loadgen.prefix_reuse import reuse_summary


@dataclass
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str | None = None  # default: /v1/completions, or /v1/chat/completions for chat
    chat: bool = False
    model: str | None = None  # default: the first of GET /v1/models
    api_key: str | None = None
    request_rates: list[float] = field(default_factory=lambda: [math.inf])
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_active_conversations: int | None = None  # multi-turn: conversations under way
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict | None = None
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    num_warmups: int = 1
    timeout_s: float = 6 * 3600.0
    result_dir: str = "."
    result_filename: str | None = None  # base name; .json added
    plots: bool = True
    disable_tqdm: bool = False
    cache_block_size: int = 16  # for the ideal prefix reuse (token-id prompts only)


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds from the start: the first at 0, then gamma gaps (shape
    `burstiness`: 1 is Poisson), scaled so that the n - 1 gaps span (n - 1) / rate: the
    run offers the rate it names whatever the draw (the arrivals of a Poisson process
    given their count in that span). Drawn as they come, one seed's draw is one
    sweep-wide bias: every rate is a scaled copy of the same gaps, and stop 82's draw
    for 320 requests offered 0.88 of each rate named (14.1 requests a second at "16",
    28.2 at "32")."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    if n > 1:
        gaps *= (n - 1) / rate / gaps.sum()
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _inputs(cfg: ServeConfig, requests: list[BenchRequest], url: str) -> list[RequestInput]:
    return [
        RequestInput(
            api_url=url,
            model=cfg.model,
            prompt=r.prompt,
            prompt_len=r.prompt_len,
            output_len=r.output_len,
            chat=cfg.chat,
            messages=r.messages,
            ignore_eos=cfg.ignore_eos,
            temperature=cfg.temperature,
            api_key=cfg.api_key,
            extra_body=cfg.extra_body,
        )
        for r in requests
    ]


async def run_load(
    cfg: ServeConfig,
    requests: list[BenchRequest],
    rate: float,
    warmups: int = 0,
    arrival_seed: int | None = None,
) -> tuple[list[RequestResult], float, float, list[str]]:
    """(results in request order, duration s, start perf_counter, warmup errors); the
    schedule drawn from `arrival_seed` (default: the config's seed)."""
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    inputs = _inputs(cfg, requests, url)
    seed = cfg.seed if arrival_seed is None else arrival_seed
    offsets = arrival_offsets(len(requests), rate, cfg.burstiness, seed)
    if requests and all(r.send_at is not None for r in requests):
        offsets = np.array([r.send_at for r in requests])  # a trace's own times
    turn_done = {
        (r.conversation_id, r.turn): asyncio.Event()
        for r in requests
        if r.conversation_id is not None
    }
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    active = (
        asyncio.Semaphore(cfg.max_active_conversations) if cfg.max_active_conversations else None
    )
    # Conversations: each send takes the schedule's next time once its turn is ready.
    slots = iter(offsets) if turn_done else None
    last_turn: dict[int, int] = {}
    started: set[int] = set()  # conversations holding a place in `active`
    for r in requests:
        if r.conversation_id is not None:
            last_turn[r.conversation_id] = max(last_turn.get(r.conversation_id, 0), r.turn)
    bar = tqdm(total=len(requests), desc=f"rate {rate:g}", disable=cfg.disable_tqdm)

    async def one(client, req: BenchRequest, inp: RequestInput) -> RequestResult:
        key = (req.conversation_id, req.turn)
        conversation = active is not None and key in turn_done
        try:
            before = turn_done.get((req.conversation_id, req.turn - 1))
            if before is not None:
                await before.wait()  # the previous turn of this conversation finished
            elif conversation:
                await active.acquire()  # its first turn: a conversation starts
                started.add(req.conversation_id)
            if slots is not None:
                delay = t0 + next(slots) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if gate is None:
                return await send_request(client, inp)
            async with gate:
                return await send_request(client, inp)
        finally:
            if key in turn_done:
                turn_done[key].set()  # even on failure, so the conversation goes on
                cid = req.conversation_id
                if conversation and req.turn == last_turn[cid] and cid in started:
                    started.discard(cid)
                    active.release()  # its last turn is done: the next one may start
            bar.update(1)

    async with make_client(cfg.timeout_s, cfg.max_concurrency) as client:
        warmup_errors = []
        for inp in inputs[:warmups]:  # not timed: the first request may compile or load
            res = await send_request(client, inp)
            if not res.success:
                warmup_errors.append(res.error)
        t0 = time.perf_counter()
        tasks = []
        for req, inp, offset in zip(requests, inputs, offsets):
            # Absolute schedule, so time spent creating tasks does not stretch the gaps.
            delay = t0 + offset - time.perf_counter()
            if delay > 0 and slots is None:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, req, inp)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration, t0, warmup_errors


def _json_safe(value):
    # JSON has no Infinity: write "inf" instead.
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(_json_safe(data), indent=2) + "\n")
    print(f"wrote {path}")


def _base_name(cfg: ServeConfig, dataset: dict) -> str:
    if cfg.result_filename:
        return cfg.result_filename.removesuffix(".json")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"serve-{dataset.get('name', 'custom')}-{stamp}"


def run_serve(
    cfg: ServeConfig, requests_by_rate: list[list[BenchRequest]], dataset: dict
) -> list[dict]:
    """Runs one benchmark per rate (rate i on `requests_by_rate[i]`), writes results
    and plots; returns the result dicts."""
    if len(requests_by_rate) != len(cfg.request_rates):
        raise ValueError(
            f"{len(requests_by_rate)} request lists for {len(cfg.request_rates)} rates"
        )
    if cfg.endpoint is None:
        cfg.endpoint = "/v1/chat/completions" if cfg.chat else "/v1/completions"
    if cfg.model is None:
        try:
            models = asyncio.run(list_models(cfg.base_url, cfg.api_key))
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot list models at {cfg.base_url}/v1/models: {exc!r}") from None
        if not models:
            raise ValueError(f"{cfg.base_url}/v1/models lists no model: pass --model")
        cfg.model = models[0]
    if cfg.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                "plots need matplotlib: pip install matplotlib, or --no-plots"
            ) from None
    out_dir = Path(cfg.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = _base_name(cfg, dataset)
    sweep = len(cfg.request_rates) > 1
    results = []
    for i, (rate, requests) in enumerate(zip(cfg.request_rates, requests_by_rate)):
        # each rate its own draw of arrivals (seed + i): one draw scaled to every rate put
        # the same bursts (in stop 82's sweep, four or five sends within 50 ms, where each
        # rate's slowest first tokens were) at the same places of every run, so that a
        # sweep's rates were not apart samples of their load
        warmups = cfg.num_warmups if i == 0 else 0
        runs, duration, t0, warmup_errors = asyncio.run(
            run_load(cfg, requests, rate, warmups=warmups, arrival_seed=cfg.seed + i)
        )
        metrics = compute_metrics(runs, duration, cfg.percentiles, cfg.goodput, t0)
        config = asdict(cfg)
        config.pop("request_rates")
        config.pop("api_key")  # never written to disk
        result = {
            "date": datetime.now().isoformat(timespec="seconds"),
            **config,
            "endpoint_type": "chat" if cfg.chat else "completions",
            "request_rate": rate,
            "arrival_seed": cfg.seed + i,
            "dataset": dataset,
            "num_prompts": len(requests),
            **metrics,
            "warmup_errors": warmup_errors,
            "failures": [
                {"index": j, "status_code": r.status_code, "error": r.error}
                for j, r in enumerate(runs)
                if not r.success
            ],
            **per_request(runs, t0),
            **reuse_summary(requests, runs, t0, cfg.cache_block_size),
            "conversation_ids": [r.conversation_id for r in requests],
            "turns": [r.turn for r in requests],
        }
        name = f"{base}-rate{rate:g}" if sweep else base
        result["plots"] = []
        if cfg.plots:
            title = f"{cfg.model}, rate {rate:g}, {dataset.get('name', '')}"
            cdf = out_dir / f"{name}-cdf.png"
            result["plots"].append(str(plot_cdfs(latency_samples(runs), cdf, title)))
            print(f"wrote {cdf}")
        result["result_file"] = str(out_dir / f"{name}.json")
        write_json(out_dir / f"{name}.json", result)
        print_summary(result, cfg.percentiles)
        results.append(result)
    if sweep:
        summary = [{k: v for k, v in r.items() if k not in _PER_REQUEST_KEYS} for r in results]
        plots = []
        if cfg.plots:
            plots = [str(p) for p in plot_sweep(results, out_dir / f"{base}-sweep")]
            for plot in plots:
                print(f"wrote {plot}")
        write_json(out_dir / f"{base}-sweep.json", {"runs": summary, "plots": plots})
        print_sweep_table(results)
    return results


def written_runs(result_dir: Path, base: str) -> list[dict]:
    """The runs a `bench serve` call with `--result-filename BASE` wrote: a sweep's
    summaries (BASE-sweep.json), or one rate's whole result (BASE.json)."""
    sweep = Path(result_dir) / f"{base}-sweep.json"
    if sweep.exists():
        return json.loads(sweep.read_text())["runs"]
    return [json.loads((Path(result_dir) / f"{base}.json").read_text())]


_PER_REQUEST_KEYS = {
    "input_lens",
    "output_lens",
    "ttfts",
    "e2els",
    "itls",
    "start_times",
    "status_codes",
    "errors",
    "conversation_ids",
    "turns",
    "cached_tokens",
    "generated_texts",
    "ideal_cached_tokens",
}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_summary(result: dict, percentiles: list[float]) -> None:
    """The run's headline numbers, laid out like vLLM's serving result block."""
    rows = [
        ("Request rate (req/s)", f"{result['request_rate']:g}"),
        ("Offered rate, as sent (req/s)", _ms(result.get("offered_rate"))),
        ("Max concurrency", result["max_concurrency"] or "-"),
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", f"{result['duration']:.2f}"),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
    ]
    if result["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", f"{result['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s)", f"{result['max_output_tokens_per_s']:.2f}"),
        ("Peak concurrent requests", result["max_concurrent_requests"]),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}"),
    ]
    if result.get("ideal_cached_tokens_total"):
        rows.append(("Cached prompt tokens", result["cached_tokens_total"]))
        rows.append(("Ideal cached prompt tokens", result["ideal_cached_tokens_total"]))
        rows.append(("Cached of ideal", f"{result['cached_of_ideal']:.3f}"))
    for name in ("ttft", "tpot", "itl", "e2el"):
        label = name.upper()
        rows.append((f"Mean {label} (ms)", _ms(result[f"mean_{name}_ms"])))
        rows.append((f"Median {label} (ms)", _ms(result[f"median_{name}_ms"])))
        for p in percentiles:
            if p != 50:  # the median, already shown
                rows.append((f"P{p:g} {label} (ms)", _ms(result[f"p{p:g}_{name}_ms"])))
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{label:<40}{value!s:>10}" for label, value in rows]
    errors = {f["error"][:200] for f in result["failures"]}
    lines += [f"error: {e}" for e in sorted(errors)[:5]]
    lines.append("=" * 50)
    print("\n".join(lines), flush=True)


def print_sweep_table(results: list[dict]) -> None:
    head = f"{'rate':>6} {'sent/s':>7} {'ok':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} "
    head += f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}"
    lines = [head]
    for r in results:
        cells = [
            r.get(k) for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
        ]
        lines.append(
            f"{r['request_rate']:>6g} {_ms(r.get('offered_rate')):>7} "
            f"{r['completed']:>5} {r['failed']:>5} "
            f"{r['request_throughput']:>8.2f} {r['output_throughput']:>10.1f} "
            + " ".join(f"{_ms(c):>9}" for c in cells)
        )
    print("\n".join(lines), flush=True)
