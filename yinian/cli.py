"""`yinian`: the commands people type.

yinian make-model --preset tiny-llama --out models/tiny-llama
yinian generate --prompt "Hello"
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from basis.flags import DefaultsFormatter
from bench.loadgen.cli import add_bench_parser
from engine.cli_args import add_engine_args, engine_options
from engine.presets import PRESETS
from yinian.kube_planner import add_planner_parser
from yinian.sim.cli import add_sim_parser
from yinian.up import add_up_parser


class HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsFormatter):
    """The command's description as written, every option's default shown."""


def _make_model(args) -> int:
    from engine.presets import TINY_PRESETS, preset_config

    config = preset_config(args.preset)  # an unknown name is said before torch is imported
    from engine.make_model import write_model

    weights = args.weights if args.weights is not None else args.preset in TINY_PRESETS
    out = write_model(args.out, config, seed=args.seed, weights=weights, dtype=args.dtype)
    kind = "with weights" if weights else "config and tokenizer only (load_format=dummy)"
    print(f"wrote {args.preset} to {out} ({kind}); presets: {', '.join(PRESETS)}")
    return 0


def _generate(args) -> int:
    from engine import SamplingParams

    # checked before the model is found or loaded (and torch imported): bad input costs
    # no engine
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.sampling_seed,
        n=args.n,
    )
    from engine import LLM
    from yinian.default_model import ensure_default_model

    model = args.model or ensure_default_model()
    llm = LLM(model, **engine_options(args))
    prompts = args.prompt or ["The quick brown fox", "In a distant galaxy"]
    if args.chat:
        prompts = [
            llm.engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts
        ]
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(args.prompt or prompts, outputs):
        for completion in out.outputs:
            record = {
                "prompt": prompt if isinstance(prompt, str) else None,
                "index": completion.index,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
    stats = llm.get_stats()
    print(
        f"# model {model}: {stats['num_tokens_processed']} tokens processed, "
        f"prefix cache hit rate {stats['prefix_cache_hit_rate']:.2f}",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yinian", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        help="what this command logs (each service of `yinian up` logs to its own file)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "make-model",
        help="write a Hugging Face model folder with random weights",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--preset", required=True, help=f"which model to write: {', '.join(PRESETS)}")
    p.add_argument("--out", required=True, help="the folder to write (made if missing)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the weights written (default: the preset's)",
    )
    p.add_argument(
        "--weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write weights (default: only for the tiny presets)",
    )
    p.set_defaults(func=_make_model)

    p = sub.add_parser(
        "generate", help="generate offline with the engine", formatter_class=DefaultsFormatter
    )
    p.add_argument("--model", help="model folder (default: a tiny model made on first use)")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for several")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per output")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    p.add_argument("--sampling-seed", type=int, help="per-request sampling seed")
    p.add_argument("-n", type=int, default=1, help="outputs per prompt")
    add_engine_args(p)
    p.set_defaults(func=_generate)

    add_up_parser(sub)
    add_bench_parser(sub)
    add_sim_parser(sub)
    add_planner_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"yinian {args.command}: error: {exc}", file=sys.stderr)
        return 2
