"""Request sets for the benchmarks, with vLLM `bench serve` semantics.

Every generator returns a list of BenchRequest. `prompt_len` is the number of
tokens the server sees: the tokenizer's special tokens (a Llama 3 BOS) are
counted, because the server adds them when it tokenizes a text prompt. With
prompt_format="ids" the prompt is that same token list, sent as token ids.

* random: body token ids (offset + i + arange(L)) mod the non-special vocab,
  decoded and re-encoded, then fixed up until the text encodes to exactly the
  requested length. Lengths are fixed or uniform in [L(1-r), L(1+r)].
* sharegpt: first two turns of a local ShareGPT JSON file, vLLM's filters.
* prefix-repetition: num_prefixes shared prefixes, each with random suffixes.
* multi-turn: users sharing one system prompt; a turn's prompt is the whole
  conversation so far. Assistant turns are synthetic (fixed length), so every
  server under test sees identical prompts.
* mooncake: a trace in Mooncake's format (traces.py), token-id prompts whose
  blocks are shared where their hash ids are, each sent at its timestamp.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.loadgen import traces

DATASETS = ("random", "sharegpt", "prefix-repetition", "multi-turn", "mooncake")


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids with prompt_format="ids"
    # Tokens a /v1/completions server sees, special tokens included. A chat
    # template adds its own tokens; the report then takes the server's usage count.
    prompt_len: int
    output_len: int  # max_tokens to ask for
    messages: list[dict] | None = None  # the same prompt for /v1/chat/completions
    conversation_id: int | None = None  # multi-turn: the user; turn k+1 waits for turn k
    turn: int = 0
    send_at: float | None = None  # a trace's: seconds after the run starts


def load_tokenizer(path: str | Path):
    """The model folder's tokenizer (engine.tokenizer.Tokenizer)."""
    from basis.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(path)
    if tok is None:
        raise ValueError(f"no tokenizer.json in {path}: pass --tokenizer DIR")
    return tok


def num_special_tokens(tok) -> int:
    """Tokens the tokenizer adds to a text prompt (1 for a Llama 3 BOS, 0 for Qwen)."""
    return len(tok.encode("a", add_special_tokens=True)) - len(
        tok.encode("a", add_special_tokens=False)
    )


def allowed_token_ids(tok) -> np.ndarray:
    return np.array([i for i in range(tok.vocab_size) if i not in tok.special_ids])


def fit_text(tok, ids, target: int, rng, allowed: np.ndarray, head: str = "") -> str:
    """Text that encodes (after `head`, without special tokens) to exactly `target` tokens.

    Like vLLM: decode, re-encode, truncate or extend, repeat. vLLM gives up after
    ten tries and accepts a mismatch; we restart from fresh random ids instead,
    so lengths are always exact. `head` must keep its own tokens: a body whose
    first characters merge into the head's last token is redrawn, which keeps
    shared prefixes token-identical for prefix caching.
    """
    if target <= 0:
        return ""
    head_ids = tok.encode(head, add_special_tokens=False) if head else []
    n_head = len(head_ids)
    ids = [int(i) for i in ids][:target]
    for attempt in range(400):
        if attempt and attempt % 10 == 0:  # stuck in a cycle: start over
            ids = []
        if len(ids) < target:
            ids += allowed[rng.integers(0, len(allowed), target - len(ids))].tolist()
        text = tok.decode(ids)
        got = tok.encode(head + text, add_special_tokens=False)
        if got[:n_head] != head_ids:
            ids = []  # the body merged into the head: redraw
            continue
        if len(got) - n_head == target:
            return text
        ids = got[n_head:][:target]
    raise RuntimeError(f"could not make a text of exactly {target} tokens")


def _request(tok, text: str, output_len: int, prompt_format: str, **extra) -> BenchRequest:
    ids = tok.encode(text, add_special_tokens=True)
    prompt = ids if prompt_format == "ids" else text
    messages = extra.pop("messages", None) or [{"role": "user", "content": text}]
    return BenchRequest(prompt, len(ids), output_len, messages=messages, **extra)


def _check_format(prompt_format: str) -> None:
    if prompt_format not in ("text", "ids"):
        raise ValueError(f"prompt_format must be 'text' or 'ids', got {prompt_format!r}")


def random_requests(
    tok,
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    prompt_format: str = "text",
) -> list[BenchRequest]:
    _check_format(prompt_format)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    # vLLM: the requested input length includes the special tokens the server adds.
    n_special = num_special_tokens(tok)
    real_len = max(0, input_len - n_special)
    in_low, in_high = (
        math.floor(real_len * (1 - range_ratio)),
        math.ceil(real_len * (1 + range_ratio)),
    )
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = math.ceil(output_len * (1 + range_ratio))
    if prefix_len + in_low < 1:
        raise ValueError("input length too small: every prompt needs at least one token")
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, tok.vocab_size, size=num_prompts)
    allowed = allowed_token_ids(tok)
    prefix = fit_text(tok, rng.choice(allowed, size=prefix_len), prefix_len, rng, allowed)
    requests = []
    for i in range(num_prompts):
        body_ids = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)]
        body = fit_text(tok, body_ids, int(input_lens[i]), rng, allowed, head=prefix)
        requests.append(_request(tok, prefix + body, int(output_lens[i]), prompt_format))
    return requests


def sharegpt_requests(
    tok,
    path: str | Path,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
    prompt_format: str = "text",
) -> list[BenchRequest]:
    _check_format(prompt_format)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    data = [e for e in data if len(e.get("conversations") or []) >= 2]
    rand = random.Random(seed)
    rand.shuffle(data)
    requests = []
    for entry in data:
        if len(requests) >= num_prompts:
            break
        prompt, completion = (turn["value"] for turn in entry["conversations"][:2])
        prompt_len = len(tok.encode(prompt, add_special_tokens=True))
        # vLLM counts the completion with special tokens too (one BOS too many);
        # the reply a server generates has none, so we count it without.
        out_len = len(tok.encode(completion, add_special_tokens=False))
        out_len = output_len if output_len is not None else out_len
        # vLLM's filters; the short-output check is skipped for a fixed output length.
        if prompt_len < 4 or (output_len is None and out_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + out_len > 2048:
            continue
        requests.append(_request(tok, prompt, out_len, prompt_format))
    if not requests:
        raise ValueError(f"no usable conversations in {path}")
    if len(requests) < num_prompts:  # vLLM oversamples by repeating random entries
        requests += rand.choices(requests, k=num_prompts - len(requests))
    return requests


def prefix_repetition_requests(
    tok,
    num_prompts: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
    seed: int = 0,
    prompt_format: str = "text",
) -> list[BenchRequest]:
    _check_format(prompt_format)
    per_prefix = num_prompts // max(1, num_prefixes)
    if per_prefix == 0:
        raise ValueError(f"num_prompts ({num_prompts}) < num_prefixes ({num_prefixes})")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tok)

    def draw(n: int, head: str = "") -> str:
        return fit_text(tok, rng.choice(allowed, size=n), n, rng, allowed, head=head)

    requests = []
    for _ in range(num_prefixes):
        prefix = draw(prefix_len)
        for _ in range(per_prefix):
            text = prefix + draw(suffix_len, head=prefix)
            requests.append(_request(tok, text, output_len, prompt_format))
    # Shuffled so that prompts sharing a prefix do not arrive back to back.
    return [requests[i] for i in rng.permutation(len(requests))]


def render_conversation(tok, messages: list[dict]) -> str:
    """The completions-endpoint text of a conversation awaiting the assistant's reply."""
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        # The server adds BOS to a text prompt itself; keep it from doubling.
        if tok.bos_token and text.startswith(tok.bos_token):
            text = text[len(tok.bos_token) :]
        return text
    parts = [f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages]
    return "".join(parts) + "Assistant: "


def multi_turn_requests(
    tok,
    num_users: int,
    num_turns: int = 4,
    system_len: int = 256,
    user_len: int = 64,
    output_len: int = 64,
    seed: int = 0,
    prompt_format: str = "text",
) -> list[BenchRequest]:
    """num_users x num_turns requests, ordered turn by turn (all first turns, then
    all second turns, ...). The driver holds turn k+1 of a user until turn k is done."""
    _check_format(prompt_format)
    if num_users < 1 or num_turns < 1:
        raise ValueError("multi-turn needs at least one user and one turn")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tok)

    def draw(n: int) -> str:
        return fit_text(tok, rng.choice(allowed, size=n), n, rng, allowed)

    system = draw(system_len)
    by_turn: list[list[BenchRequest]] = [[] for _ in range(num_turns)]
    for user in range(num_users):
        messages = [{"role": "system", "content": system}] if system else []
        for turn in range(num_turns):
            messages.append({"role": "user", "content": draw(user_len)})
            text = render_conversation(tok, messages)
            req = _request(
                tok, text, output_len, prompt_format, messages=[dict(m) for m in messages]
            )
            req.conversation_id, req.turn = user, turn
            by_turn[turn].append(req)
            # A synthetic reply of output_len tokens stands in for the server's.
            messages.append({"role": "assistant", "content": draw(output_len)})
    return [req for turn in by_turn for req in turn]


def check_prompt_lengths(tok, requests: list[BenchRequest]) -> list[tuple[int, int, int]]:
    """(index, prompt_len, tokens the server would see) for every request that differs.

    Text prompts are encoded the way a server encodes them (special tokens added);
    token-id prompts are sent as they are. An empty list means all are exact.
    """
    bad = []
    for i, req in enumerate(requests):
        if isinstance(req.prompt, str):
            seen = len(tok.encode(req.prompt, add_special_tokens=True))
        else:
            seen = len(req.prompt)
        if seen != req.prompt_len:
            bad.append((i, req.prompt_len, seen))
    return bad


def mooncake_requests(
    tok,
    path: str,
    num_prompts: int,
    seed: int = 0,
    prompt_format: str = "ids",
    block_tokens: int = traces.BLOCK_TOKENS,
    slowdown: float = 1.0,
) -> list[BenchRequest]:
    """The first `num_prompts` entries of a Mooncake-format trace, as token-id prompts
    sent at the trace's times (`slowdown` stretches them)."""
    _check_format(prompt_format)
    if prompt_format != "ids":
        raise ValueError("a mooncake trace's prompts are token ids: use --prompt-format ids")
    entries = traces.read_trace(path, num_prompts, block_tokens)
    rows = traces.trace_requests(entries, allowed_token_ids(tok), seed, block_tokens, slowdown)
    return [BenchRequest(r["prompt"], len(r["prompt"]), r["output_len"], send_at=r["send_at"])
            for r in rows]  # fmt: skip
