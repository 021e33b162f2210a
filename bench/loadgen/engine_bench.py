"""`yinian bench engine`: offline throughput of our engine, in process, no network.

All requests are queued at once and run to completion; elapsed time is from
queuing the first to finishing the last (model load and a short warmup are
excluded). Greedy decoding with ignore_eos, so every request generates exactly
its output_len tokens and two systems do the same work.

With peer="transformers" the same prompts run through Hugging Face
transformers' continuous batching (`model.generate_batch`, transformers >= 4.53)
in the same process, and the report gives engine/peer ratios. The peer's
elapsed time is its requests' span (first queued to last finished, from the
timestamps it records), so its manager setup is excluded as our load is.
"""

from __future__ import annotations

import gc
import math
import time
from datetime import datetime
from pathlib import Path

from bench.loadgen.datasets import BenchRequest
from bench.loadgen.serve import write_json

_RATES = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")


def _figures(elapsed: float, n: int, n_in: int, n_out: int) -> dict:
    elapsed = max(elapsed, 1e-9)
    return {
        "elapsed_s": elapsed,
        "num_requests": n,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "requests_per_s": n / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
    }


def run_engine(model: str, requests: list[BenchRequest], options: dict) -> dict:
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **options)
    load_s = time.perf_counter() - start
    prompts = [r.prompt for r in requests]
    params = [
        SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in requests
    ]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = _figures(elapsed, len(requests), n_in, n_out)
    result["load_s"] = load_s
    result["device"] = str(llm.engine.runner.device)
    del llm, outputs
    _free_memory()
    return result


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _attn_implementation(transformers) -> str:
    # 5.0-5.22 spell the paged SDPA kernel "paged|sdpa"; later 5.x deprecate the
    # prefix (the CB manager picks the paged path itself) and take plain "sdpa".
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "sdpa" if (major, minor) >= (5, 23) else "paged|sdpa"


def _cb_kwargs(requests_ids, output_lens, device: str, overrides: dict) -> dict:
    """ContinuousBatchingConfig keyword arguments. On CPU the paged cache is sized to
    the workload: left to itself transformers sizes it from memory, which on a CPU
    machine takes tens of seconds. On GPU its own sizing is kept."""
    kwargs = dict(overrides)
    if device == "cpu":
        page = kwargs.get("page_size", 256)
        needed = sum(math.ceil((len(p) + o) / page) for p, o in zip(requests_ids, output_lens))
        kwargs.setdefault("num_blocks", needed + 1)
        total_prompt = sum(len(p) for p in requests_ids)
        kwargs.setdefault("max_batch_tokens", max(256, min(4096, total_prompt)))
    return kwargs


def run_transformers(
    model: str, prompt_ids: list[list[int]], output_lens: list[int], options: dict, peer: dict
) -> dict:
    """Hugging Face continuous batching on the same prompts; {"error": ...} if it cannot run."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig
    except ImportError as exc:
        return {"error": f"transformers is not installed: {exc}"}
    device = options.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = options.get("dtype", "auto")
    attn = peer.get("attn_implementation") or _attn_implementation(transformers)
    try:
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        if peer.get("random_weights"):  # a folder without weights (our dummy load format)
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model)
            with torch.device(device):
                hf = AutoModelForCausalLM.from_config(
                    config, dtype=torch_dtype, attn_implementation=attn
                )
        else:
            hf = AutoModelForCausalLM.from_pretrained(
                model, dtype=torch_dtype, attn_implementation=attn
            ).to(device)
    except Exception as exc:  # noqa: BLE001 - any load failure is reported, not raised
        return {"error": f"loading {model} in transformers failed: {type(exc).__name__}: {exc}"}
    if not hasattr(hf, "generate_batch"):
        return {
            "error": f"transformers {transformers.__version__} has no generate_batch "
            "(continuous batching arrived in 4.53)"
        }
    uniform = len(set(output_lens)) == 1
    # eos_token_id=-1: no token ends a request, so each makes exactly its output_len.
    gen = GenerationConfig(
        max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    from transformers import ContinuousBatchingConfig

    cb_kwargs = _cb_kwargs(prompt_ids, output_lens, device, peer.get("cb_config") or {})
    cb = ContinuousBatchingConfig(**cb_kwargs)
    cb_text = ", ".join(f"{k}={v!r}" for k, v in cb_kwargs.items())
    call = (
        f"AutoModelForCausalLM.from_pretrained(model, attn_implementation={attn!r})"
        f".generate_batch(inputs=list[list[int]], generation_config=GenerationConfig("
        f"max_new_tokens={max(output_lens)}, do_sample=False, eos_token_id=-1), "
        f"continuous_batching_config=ContinuousBatchingConfig({cb_text}))"
    )
    try:
        warm = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
        hf.generate_batch(
            inputs=prompt_ids[:1], generation_config=warm, continuous_batching_config=cb
        )
        start = time.perf_counter()
        if uniform:
            outs = hf.generate_batch(
                inputs=prompt_ids, generation_config=gen, continuous_batching_config=cb
            )
            outs = list(outs.values())
        else:
            call = "per-request max_new_tokens via continuous_batching_context_manager; " + call
            outs = _manager_run(hf, prompt_ids, output_lens, gen, cb)
        wall = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001
        return {"error": f"generate_batch failed: {type(exc).__name__}: {exc}", "call": call}
    finally:
        del hf
        _free_memory()
    errors = [o.error for o in outs if o.error]
    spans = [o.lifespan[1] for o in outs if o.lifespan[1] > 0]
    elapsed = max(spans) - min(o.created_time for o in outs) if len(spans) == len(outs) else wall
    n_in = sum(len(p) for p in prompt_ids)
    n_out = sum(len(o.generated_tokens) for o in outs)
    result = _figures(elapsed, len(outs), n_in, n_out)
    result.update(
        wall_s=wall,
        transformers_version=transformers.__version__,
        attn_implementation=attn,
        device=device,
        call=call,
    )
    if len(outs) != len(prompt_ids) or errors:
        result["error"] = f"{len(prompt_ids) - len(outs)} missing, errors: {errors[:3]}"
    return result


def _manager_run(hf, prompt_ids, output_lens, gen, cb) -> list:
    with hf.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=5
    ) as manager:
        ids = [
            manager.add_request(input_ids=p, max_new_tokens=o, eos_token_id=-1)
            for p, o in zip(prompt_ids, output_lens)
        ]
        done = {}
        while len(done) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                done[out.request_id] = out
            elif out is None and not manager.is_running():
                break
    return [done[i] for i in ids if i in done]


def run_engine_bench(
    model: str,
    requests: list[BenchRequest],
    engine_options: dict | None = None,
    peer: str | None = None,
    peer_options: dict | None = None,
    dataset: dict | None = None,
    result_dir: str = ".",
    result_filename: str | None = None,
    tokenizer=None,
) -> dict:
    """Runs the engine (and the peer), writes the JSON, prints a table; returns the result."""
    options = dict(engine_options or {})
    result = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "model": str(model),
        "engine_options": options,
        "dataset": dataset or {},
        "engine": run_engine(str(model), requests, options),
    }
    if peer == "transformers":
        prompt_ids = [
            r.prompt if isinstance(r.prompt, list) else tokenizer.encode(r.prompt) for r in requests
        ]
        output_lens = [r.output_len for r in requests]
        result["peer"] = run_transformers(
            str(model), prompt_ids, output_lens, options, peer_options or {}
        )
        result["peer_name"] = peer
        ours, theirs = result["engine"], result["peer"]
        if "error" not in theirs:
            # Ratios compare like with like only if both made the same tokens.
            result["same_work"] = ours["total_output_tokens"] == theirs["total_output_tokens"]
            result["ratio"] = {k: ours[k] / theirs[k] for k in _RATES if theirs[k] > 0}
    elif peer is not None:
        raise ValueError(f"unknown peer {peer!r}; the peer is 'transformers'")
    out_dir = Path(result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = result_filename or f"engine-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path = out_dir / f"{name.removesuffix('.json')}.json"
    result["result_file"] = str(path)
    write_json(path, result)
    print_engine_table(result)
    return result


def print_engine_table(result: dict) -> None:
    rows = [("engine", result["engine"])]
    if "peer" in result:
        rows.append((result["peer_name"], result["peer"]))
    lines = [f"{'system':<14}{'elapsed s':>10}{'req/s':>10}{'out tok/s':>12}{'total tok/s':>13}"]
    for label, r in rows:
        if "error" in r and "elapsed_s" not in r:
            lines.append(f"{label:<14}error: {r['error']}")
            continue
        lines.append(
            f"{label:<14}{r['elapsed_s']:>10.3f}{r['requests_per_s']:>10.2f}"
            f"{r['output_tokens_per_s']:>12.1f}{r['total_tokens_per_s']:>13.1f}"
        )
        if "error" in r:
            lines.append(f"{'':<14}error: {r['error']}")
    if "ratio" in result:
        ratio = [result["ratio"].get(k, 0.0) for k in _RATES]
        lines.append(f"{'ratio':<14}{'':>10}{ratio[0]:>10.2f}{ratio[1]:>12.2f}{ratio[2]:>13.2f}")
    print("\n".join(lines), flush=True)
