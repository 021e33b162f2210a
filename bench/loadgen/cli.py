"""`yinian bench serve` and `yinian bench engine`: flags, and the glue to the modules.

yinian bench serve --base-url http://127.0.0.1:8000 --tokenizer models/tiny-llama \\
    --dataset-name random --random-input-len 1024 --random-output-len 128 \\
    --request-rates 1,2,4,inf --goodput ttft:500 tpot:50
yinian bench engine --model models/tiny-llama --num-prompts 64 --input-len 128 \\
    --output-len 64 --peer transformers

The lead's yinian/cli.py calls add_bench_parser(sub); run(argv) does the same
for `python -m bench.loadgen.cli` and tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from basis.flags import DefaultsFormatter
from bench.loadgen import datasets


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are numbers or inf: {text!r}") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0: {text!r}")
    return rates


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _add_dataset_args(p: argparse.ArgumentParser, seed_flags: tuple[str, ...]) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=datasets.DATASETS, default="random",
                   help="the prompts: random token ids, ShareGPT conversations, repeated "
                   "prefixes, or multi-turn conversations")  # fmt: skip
    g.add_argument("--dataset-path", help="ShareGPT JSON file (sharegpt), trace JSONL (mooncake)")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests sent (per rate)")
    g.add_argument(*seed_flags, dest="seed", type=int, default=0, help="dataset and arrival seed")
    g.add_argument(
        "--prompt-format",
        choices=("text", "ids"),
        default="text",
        help="send prompts as text or as the token ids the server would see",
    )
    g.add_argument("--random-input-len", "--input-len", type=int, default=1024,
                   help="prompt tokens (random)")  # fmt: skip
    g.add_argument("--random-output-len", "--output-len", type=int, default=128,
                   help="tokens to generate (random)")  # fmt: skip
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths vary uniformly by this fraction either side (random)")  # fmt: skip
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one prefix every prompt starts with (random)")  # fmt: skip
    g.add_argument("--sharegpt-output-len", type=int, help="fixed output length (sharegpt)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="tokens of each shared prefix (prefix-repetition)")  # fmt: skip
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="tokens after it, in each prompt its own (prefix-repetition)")  # fmt: skip
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="distinct prefixes the prompts share (prefix-repetition)")  # fmt: skip
    g.add_argument("--prefix-repetition-output-len", type=int, default=128,
                   help="tokens to generate (prefix-repetition)")  # fmt: skip
    g.add_argument("--multi-turn-num-turns", type=int, default=4,
                   help="turns of each conversation (multi-turn)")  # fmt: skip
    g.add_argument("--multi-turn-system-len", type=int, default=256,
                   help="tokens of each conversation's system prompt (multi-turn)")  # fmt: skip
    g.add_argument("--multi-turn-user-len", type=int, default=64,
                   help="tokens of each user message (multi-turn)")  # fmt: skip
    g.add_argument("--multi-turn-output-len", type=int, default=64,
                   help="tokens to generate per turn (multi-turn)")  # fmt: skip
    g.add_argument("--mooncake-block-size", type=int, default=512,
                   help="tokens a trace's hash id stands for (mooncake)")  # fmt: skip
    g.add_argument(
        "--mooncake-slowdown-factor",
        type=float,
        default=1.0,
        help="stretches the trace's times: 2 sends at half its pace (mooncake)",
    )


def build_requests(args, tok) -> tuple[list[datasets.BenchRequest], dict]:
    """The requests the flags describe, and the dataset's parameters for the report."""
    name, fmt, n, seed = args.dataset_name, args.prompt_format, args.num_prompts, args.seed
    info = {"name": name, "prompt_format": fmt, "seed": seed}
    if name == "random":
        info.update(
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
        )
        reqs = datasets.random_requests(tok, n, **_pick(info), prompt_format=fmt)
    elif name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE")
        info.update(path=args.dataset_path, output_len=args.sharegpt_output_len)
        reqs = datasets.sharegpt_requests(
            tok, args.dataset_path, n, args.sharegpt_output_len, seed, fmt
        )
    elif name == "prefix-repetition":
        info.update(
            prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len,
            num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len,
        )
        reqs = datasets.prefix_repetition_requests(tok, n, **_pick(info), prompt_format=fmt)
    elif name == "mooncake":
        if not args.dataset_path:
            raise ValueError("--dataset-name mooncake needs --dataset-path FILE (a JSONL trace)")
        info.update(path=args.dataset_path, block_tokens=args.mooncake_block_size,
                    slowdown=args.mooncake_slowdown_factor)  # fmt: skip
        reqs = datasets.mooncake_requests(
            tok, args.dataset_path, n, seed, fmt, args.mooncake_block_size,
            args.mooncake_slowdown_factor,
        )  # fmt: skip
    else:  # multi-turn: num_prompts requests = users x turns
        turns = args.multi_turn_num_turns
        info.update(
            num_users=max(1, n // turns),
            num_turns=turns,
            system_len=args.multi_turn_system_len,
            user_len=args.multi_turn_user_len,
            output_len=args.multi_turn_output_len,
        )
        reqs = datasets.multi_turn_requests(tok, **_pick(info), prompt_format=fmt)
    return reqs, info


def _pick(info: dict) -> dict:
    # The dataset function's keyword arguments: everything but the report-only keys.
    return {k: v for k, v in info.items() if k not in ("name", "prompt_format")}


def _serve(args) -> int:
    from bench.loadgen.metrics import parse_goodput
    from bench.loadgen.serve import ServeConfig, run_serve

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    tokenizer = args.tokenizer or args.model
    if not tokenizer or not Path(tokenizer).is_dir():
        tokenizer = _served_folder(base_url, args.api_key)
    tok = datasets.load_tokenizer(tokenizer)
    rates = args.request_rates or [args.request_rate]
    chat = args.backend == "openai-chat" or "chat/completions" in (args.endpoint or "")
    if args.dataset_name == "mooncake":
        if rates != [math.inf]:
            raise ValueError(
                "a mooncake trace is sent at its own times: --request-rate(s) do not apply "
                "(--mooncake-slowdown-factor does)"
            )
        if chat:
            raise ValueError("a mooncake trace's prompts are token ids: /v1/completions only")
    requests, info = build_requests(args, tok)
    per_rate = [requests] * len(rates)
    if len(rates) > 1 and not args.sweep_repeat_requests:
        # A server with a prefix cache answers a repeated prompt from its cache: each rate
        # after the first gets its own prompts (seed + i) so that every run measures prefill.
        per_rate[1:] = [
            build_requests(argparse.Namespace(**{**vars(args), "seed": args.seed + i}), tok)[0]
            for i in range(1, len(rates))
        ]
        info["seeds"] = [args.seed + i for i in range(len(rates))]
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.max_active_conversations is not None and args.max_active_conversations < 1:
        raise ValueError("--max-active-conversations must be >= 1")
    cfg = ServeConfig(
        base_url=base_url,
        endpoint=args.endpoint,
        chat=chat,
        model=args.model_name or (None if Path(str(args.model)).is_dir() else args.model),
        api_key=args.api_key,
        request_rates=rates,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        max_active_conversations=args.max_active_conversations,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        goodput=parse_goodput(args.goodput),
        percentiles=[float(p) for p in args.metric_percentiles.split(",")],
        num_warmups=args.num_warmups,
        timeout_s=args.timeout,
        result_dir=args.result_dir,
        result_filename=args.result_filename,
        plots=args.plots,
        disable_tqdm=args.disable_tqdm,
        cache_block_size=args.cache_block_size,
    )
    info["tokenizer"] = str(tokenizer)
    results = run_serve(cfg, per_rate, info)
    # Exit 1 when every request of some run failed: the numbers would mean nothing.
    return 1 if any(r["completed"] == 0 for r in results) else 0


def _served_folder(base_url: str, api_key: str | None) -> str:
    """The tokenizer's folder, asked of the server: its first model's `root` in
    /v1/models, when that is a folder on this machine."""
    import asyncio

    import httpx

    from bench.loadgen.client import model_cards

    try:
        cards = asyncio.run(model_cards(base_url, api_key))
    except httpx.HTTPError as exc:
        raise ValueError(
            f"--tokenizer DIR is required: {base_url}/v1/models did not answer ({exc!r})"
        ) from None
    root = next((c.get("root") for c in cards if c.get("root")), None)
    if not root or not (Path(root) / "tokenizer.json").is_file():
        raise ValueError(
            f"--tokenizer DIR is required: {base_url} serves no model folder on this machine"
        )
    return root


def _engine(args) -> int:
    from bench.loadgen.engine_bench import run_engine_bench
    from engine.cli_args import engine_options

    model = args.model
    if model is None:
        from yinian.default_model import ensure_default_model

        model = ensure_default_model()
    tok = datasets.load_tokenizer(model)
    requests, info = build_requests(args, tok)
    options = {**(args.engine_options or {}), **engine_options(args)}
    peer_options = {
        "attn_implementation": args.peer_attn_implementation,
        "cb_config": args.peer_cb_config,
    }
    result = run_engine_bench(
        model,
        requests,
        engine_options=options,
        peer=args.peer,
        peer_options=peer_options,
        dataset=info,
        result_dir=args.result_dir,
        result_filename=args.result_filename,
        tokenizer=tok,
    )
    if "error" in result.get("peer", {}):
        print(f"yinian bench engine: peer failed: {result['peer']['error']}")
    return 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmark a server or the engine",
                                  formatter_class=DefaultsFormatter)  # fmt: skip
    sub = bench.add_subparsers(dest="bench_command", required=True)

    p = sub.add_parser("serve", help="load an OpenAI-compatible server (vLLM bench serve)",
                       formatter_class=DefaultsFormatter)  # fmt: skip
    g = p.add_argument_group("server")
    g.add_argument("--base-url", help="default: http://HOST:PORT")
    g.add_argument("--host", default="127.0.0.1", help="the server's host (without --base-url)")
    g.add_argument("--port", type=int, default=8000, help="the server's port (without --base-url)")
    g.add_argument("--backend", choices=("openai", "openai-chat"), default="openai",
                   help="completions or chat completions")  # fmt: skip
    g.add_argument("--endpoint", help="default: /v1/completions or /v1/chat/completions")
    g.add_argument("--model", help="model name to send, or a model folder (also the tokenizer)")
    g.add_argument("--model-name", help="name to send when --model is a folder")
    g.add_argument(
        "--tokenizer",
        help="model folder with tokenizer.json (default: --model, else the folder the server "
        "names in /v1/models)",
    )
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY)")  # fmt: skip
    _add_dataset_args(p, ("--seed", "--dataset-seed"))
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: all at once")
    g.add_argument("--request-rates", type=_rates, help="a sweep, e.g. 1,2,4,inf")
    g.add_argument("--sweep-repeat-requests", action="store_true",
                   help="send a sweep's first requests again at every rate (default: each rate "
                   "draws its own with seed + its index, so no rate is served from the prefix "
                   "cache an earlier rate filled)")  # fmt: skip
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int,
                   help="requests in flight at most (default: no limit)")  # fmt: skip
    g.add_argument("--max-active-conversations", type=int,
                   help="multi-turn: conversations under way at most, a new one starting when "
                   "one has finished its last turn (default: no limit, so every "
                   "conversation's first turn is sent before any second turn)")  # fmt: skip
    g.add_argument("--num-warmups", type=int, default=1,
                   help="requests sent and not counted before the first rate")  # fmt: skip
    g.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    g.add_argument("--metric-percentiles", default="50,90,99",
                   help="percentiles reported for every latency")  # fmt: skip
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate every requested token, end of sequence or not")  # fmt: skip
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature sent (0: greedy)")  # fmt: skip
    g.add_argument("--extra-body", type=_json_dict, help="JSON merged into every request")
    g.add_argument("--timeout", type=float, default=6 * 3600.0,
                   help="seconds a response may stay silent before it fails")  # fmt: skip
    _add_output_args(p)
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                   help="write PNG plots of the latencies beside the JSON")  # fmt: skip
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument(
        "--cache-block-size",
        type=int,
        default=16,
        help="the server's KV block size, for the ideal prefix reuse reported next to its "
        "cached tokens (token-id prompts only)",
    )
    p.set_defaults(func=_serve)

    from engine.cli_args import add_engine_args

    p = sub.add_parser("engine", help="offline throughput of the engine, in process",
                       formatter_class=DefaultsFormatter)  # fmt: skip
    p.add_argument("--model", help="model folder (default: a tiny model made on first use)")
    _add_dataset_args(p, ("--dataset-seed",))  # --seed is the engine's own option
    p.add_argument("--engine-options", type=_json_dict, help="engine options as a JSON object")
    p.add_argument("--peer", choices=("transformers",), help="also run this system and compare")
    p.add_argument("--peer-attn-implementation", help="default: sdpa (paged|sdpa before 5.23)")
    p.add_argument("--peer-cb-config", type=_json_dict, help="ContinuousBatchingConfig kwargs")
    _add_output_args(p)
    add_engine_args(p)
    # Token ids by default: the peer takes ids, and tokenizing is not engine work.
    p.set_defaults(func=_engine, prompt_format="ids")
    return bench


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--result-dir", default=".", help="folder the result files are written to")
    p.add_argument("--result-filename", help="base name of the result files")


def run(argv: list[str]) -> int:
    """`yinian bench ARGV...` without the rest of the yinian command."""
    parser = argparse.ArgumentParser(prog="yinian")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


if __name__ == "__main__":
    import sys

    try:
        sys.exit(run(sys.argv[1:]))
    except ValueError as exc:  # bad flags or inputs: a message, not a traceback
        print(f"yinian bench: error: {exc}", file=sys.stderr)
        sys.exit(2)
