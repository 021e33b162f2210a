"""Request traces in Mooncake's format (its FAST'25 release): one JSON object a
line, `timestamp` (ms from the trace's start), `input_length` and
`output_length` (tokens) and `hash_ids` (one id a `block_tokens`-token block
of the prompt; two requests with the same leading ids share that prefix).

`read_trace` checks a file and returns its entries; `trace_requests` turns
them into token-id prompts whose blocks are the same wherever their ids are
(each id's tokens are drawn from a generator seeded by the id), sent at the
trace's times (`send_at`, scaled by a slowdown factor); `make_trace` writes a
small synthetic trace of conversations sharing system prompts, for tests and
dry runs:

    python -m bench.loadgen.traces --out trace.jsonl --requests 200 --rate 4
"""

from __future__ import annotations

import argparse
import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512  # Mooncake's block


@dataclass(frozen=True)
class TraceEntry:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None,
               block_tokens: int = BLOCK_TOKENS) -> list[TraceEntry]:  # fmt: skip
    """The first `limit` entries of a trace file (all with None), checked: each line
    a JSON object with a non-negative timestamp, lengths ≥ 1, and as many hash ids
    as the prompt has blocks; timestamps never go back."""
    entries: list[TraceEntry] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(entries) >= limit:
                break
            if not line.strip():
                continue
            entries.append(_entry(line, number, block_tokens))
            if len(entries) > 1 and entries[-1].timestamp_ms < entries[-2].timestamp_ms:
                raise ValueError(f"{path}:{number}: timestamp goes back in time")
    if not entries:
        raise ValueError(f"{path}: no trace entries")
    return entries


def _entry(line: str, number: int, block_tokens: int) -> TraceEntry:
    where = f"trace line {number}"
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object")
    missing = {"timestamp", "input_length", "output_length", "hash_ids"} - set(raw)
    if missing:
        raise ValueError(f"{where}: missing {', '.join(sorted(missing))}")
    stamp, inp, out, ids = (raw[k] for k in ("timestamp", "input_length", "output_length",
                                              "hash_ids"))  # fmt: skip
    if not isinstance(stamp, int | float) or isinstance(stamp, bool) or stamp < 0:
        raise ValueError(f"{where}: timestamp must be a number >= 0 (ms)")
    for name, value in (("input_length", inp), ("output_length", out)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {name} must be an integer >= 1")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    blocks = -(-inp // block_tokens)
    if len(ids) != blocks:
        raise ValueError(
            f"{where}: {len(ids)} hash ids for {inp} tokens ({blocks} blocks of {block_tokens})"
        )
    return TraceEntry(float(stamp), inp, out, tuple(ids))


def trace_requests(
    entries: list[TraceEntry],
    allowed: np.ndarray,
    seed: int = 0,
    block_tokens: int = BLOCK_TOKENS,
    slowdown: float = 1.0,
) -> list[dict]:
    """Per entry: `prompt` (token ids: each hash id's block drawn from `allowed` by a
    generator seeded with (seed, id), the last block cut to the prompt's length),
    `output_len` and `send_at` (seconds after the first entry, times `slowdown`)."""
    if slowdown <= 0:
        raise ValueError(f"the slowdown factor must be > 0, got {slowdown}")
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = np.random.default_rng([seed, hash_id])
            blocks[hash_id] = rng.choice(allowed, size=block_tokens).tolist()
        return blocks[hash_id]

    start = entries[0].timestamp_ms
    out = []
    for e in entries:
        ids = [t for h in e.hash_ids for t in block(h)][: e.input_length]
        out.append({"prompt": ids, "output_len": e.output_length,
                    "send_at": (e.timestamp_ms - start) / 1e3 * slowdown})  # fmt: skip
    return out


def make_trace(requests: int, rate: float, seed: int = 0, systems: int = 4,
               system_blocks: int = 2, turns: int = 3, user_tokens: tuple[int, int] = (64, 700),
               output_tokens: tuple[int, int] = (16, 128),
               block_tokens: int = BLOCK_TOKENS) -> list[dict]:  # fmt: skip
    """A synthetic Mooncake-format trace: conversations arrive as a Poisson process
    at `rate`, each on one of `systems` shared system prompts (`system_blocks`
    blocks), with up to `turns` turns whose prompts carry the history (earlier
    turns' blocks again, then new ones); the first `requests` entries in time
    order. Conversations keep coming until that many entries have begun, so the
    later turns of the last conversations are there beside their first turns and
    the rate does not fall off at the end (nor rise at the start)."""
    rng = np.random.default_rng(seed)
    next_id = systems * system_blocks
    entries: list[dict] = []
    later: list[float] = []  # entries' times not yet reached by `now` (a heap)
    begun = 0  # entries at or before `now`
    now = 0.0
    while begun < requests:
        now += rng.exponential(1.0 / rate)
        while later and later[0] <= now:
            heapq.heappop(later)
            begun += 1
        system = int(rng.integers(systems))
        history = list(range(system * system_blocks, (system + 1) * system_blocks))
        tokens = system_blocks * block_tokens
        at = now
        for _ in range(int(rng.integers(1, turns + 1))):
            tokens += int(rng.integers(*user_tokens))
            need = -(-tokens // block_tokens)
            while len(history) < need:
                history.append(next_id)
                next_id += 1
            out = int(rng.integers(*output_tokens))
            entries.append({"timestamp": round(at * 1e3), "input_length": tokens,
                            "output_length": out, "hash_ids": history[:need]})  # fmt: skip
            heapq.heappush(later, at)
            # the next turn's prompt holds this one's whole blocks and the answer; a
            # partly filled last block is new in it (its tokens differ once extended)
            tokens += out
            history = history[: tokens // block_tokens]
            at += float(rng.uniform(2.0, 10.0))  # the user reads and types
    entries.sort(key=lambda e: e["timestamp"])
    return entries[:requests]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=4.0, help="conversations a second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    entries = make_trace(args.requests, args.rate, args.seed)
    args.out.write_text("".join(json.dumps(e) + "\n" for e in entries))
    print(f"wrote {len(entries)} entries to {args.out}")


if __name__ == "__main__":
    main()
