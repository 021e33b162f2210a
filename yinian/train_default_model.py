"""Trains the default model `yinian up` serves: a ~1M-parameter Llama on the
interpreter's own documentation (see default_corpus), with a byte-level BPE
tokenizer learned from the same text. The result is the committed checkpoint
folder yinian/models/pydoc-llama (a few MB), loadable by Hugging Face
transformers and by the engine.

    python -m yinian.train_default_model --out yinian/models/pydoc-llama

Needs transformers (the test extra). The committed model took 700 steps of 16
windows of 256 tokens (0.3 s a step on two idle CPU cores) and reached a
held-out perplexity of 24.6 with its 2048-token vocabulary (training.json).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from basis.tokenizer import Tokenizer
from engine.tokenizer_builder import write_tokenizer
from yinian.default_corpus import (
    LOOKUP_TOOL,
    chat_samples,
    held_out_text,
    split_topics,
    tool_sample_marker,
    topics,
)

ARCHITECTURE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def documents(tokenizer: Tokenizer, names: list[str], seed: int) -> list[list[int]]:
    """Each training topic as one document, then each chat sample rendered by the template."""
    eos = tokenizer.token_to_id("<|end_of_text|>")
    all_topics = topics()
    docs = [tokenizer.encode(all_topics[n]) + [eos] for n in names]
    for messages in chat_samples(names, seed):
        tools = [LOOKUP_TOOL] if tool_sample_marker(messages) else None
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tools=tools)
        docs.append(tokenizer.encode(text, add_special_tokens=False))
    return docs


def tokenizer_corpus(names: list[str], seed: int) -> list[str]:
    all_topics = topics()
    lines = [line + "\n" for n in names for line in all_topics[n].splitlines()]
    for messages in chat_samples(names, seed):
        lines += [m["content"] + "\n" for m in messages if m.get("content")]
    return lines


def perplexity(model, ids: list[int], context: int) -> float:
    """exp of the mean next-token loss over consecutive windows of `context` tokens."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, context):
            window = torch.tensor(ids[start : start + context + 1])[None]
            if window.shape[1] < 2:
                break
            logits = model(window[:, :-1]).logits[0]
            loss = torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum")
            total += float(loss)
            count += window.shape[1] - 1
    return math.exp(total / count)


def train(args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names, held = split_topics()
    ids = write_tokenizer(
        out, args.vocab_size, style="llama3", seed=args.seed, corpus=tokenizer_corpus(names, 0)
    )
    tokenizer = Tokenizer.from_pretrained(out)
    config = dict(ARCHITECTURE, vocab_size=args.vocab_size, **ids)
    docs = documents(tokenizer, names, args.seed)
    held_ids = tokenizer.encode(held_out_text(held))
    stream = [t for d in docs for t in d]
    print(f"{len(docs)} documents, {len(stream)} training tokens, {len(held_ids)} held out")

    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    model = LlamaForCausalLM(hf_config)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    rng = random.Random(args.seed)
    data = torch.tensor(stream)
    started = time.monotonic()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 50)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = [rng.randrange(len(stream) - args.context - 1) for _ in range(args.batch)]
        batch = torch.stack([data[s : s + args.context + 1] for s in starts])
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            model.eval()
            held_ppl = perplexity(model, held_ids, args.context)
            model.train()
            print(
                f"step {step} loss {loss.item():.3f} held-out perplexity {held_ppl:.1f} "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    model.eval()
    held_ppl = perplexity(model, held_ids, args.context)
    print(f"held-out perplexity {held_ppl:.2f} (vocabulary {args.vocab_size})")

    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    report = {
        "corpus": "pydoc_data.topics",
        "held_out_topics": held,
        "steps": args.steps,
        "batch": args.batch,
        "context": args.context,
        "parameters": params,
        "held_out_perplexity": round(held_ppl, 2),
        "seconds": round(time.monotonic() - started),
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "models" / "pydoc-llama"))
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
