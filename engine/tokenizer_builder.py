"""Offline construction of real byte-level BPE tokenizers for synthetic checkpoints.

``yinian make-model`` writes Hugging Face checkpoint folders with random weights.
Nothing can be fetched from a model hub, yet the rest of the engine (chat
templates, stop tokens, detokenization, ``AutoTokenizer``) needs a genuine
tokenizer whose vocabulary size matches the model's embedding table exactly.
This module builds one locally with the ``tokenizers`` library:

* byte-level BPE over the 256 GPT-2 byte symbols, so any text round-trips;
* merges learned from a small built-in English/code corpus, then padded with
  deterministic synthetic merges until the requested size is reached;
* special tokens at the top of the id space, laid out like Llama 3 or Qwen.

The entry point is :func:`write_tokenizer`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

__all__ = ["STYLES", "MIN_VOCAB_SIZE", "write_tokenizer"]

MIN_VOCAB_SIZE = 300
MODEL_MAX_LENGTH = 131072

# The two pre-tokenizer regexes differ only in digit grouping (Llama 3 groups up
# to three digits, Qwen splits every digit). Matching the originals keeps the
# token statistics of synthetic models close to the real ones.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Literal token strings instead of ``bos_token`` so the templates also render
# with a plain jinja2 environment that is not given the special-token variables.
_LLAMA3_CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    # Tools (when given) go first, as a system turn; a call is answered with a bare JSON
    # object {"name": ..., "parameters": ...}, as Llama 3.1 does with JSON tool calling.
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'To call a function, answer with only a JSON object ' }}"
    '{{- \'{"name": function name, "parameters": its arguments}. Functions:\' }}'
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- {'name': call['function']['name'], "
    "'parameters': call['function']['arguments']} | tojson }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{%- if message['content'] is not string %}"
    "{{- raise_exception('Only string message content is supported.') }}"
    "{%- endif %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    # Llama 3's own template trims content; keep that so prompts tokenize alike.
    "{{- message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
_QWEN_CHAT_TEMPLATE = (
    # Tools (when given) go into a system turn of their own, Hermes style: calls are
    # JSON objects {"name": ..., "arguments": ...} inside <tool_call></tool_call> tags.
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions. ' }}"
    "{{- 'Their signatures are within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name ' }}"
    "{{- 'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}"
    '{{- \'{"name": <function-name>, "arguments": <args-json-object>}\\n\' }}'
    "{{- '</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '\\n<tool_call>\\n' }}"
    "{{- {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}"
    "{{- '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if message['content'] is not string %}"
    "{{- raise_exception('Only string message content is supported.') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

STYLES: dict[str, dict] = {
    "llama3": {
        "special": [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|eot_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
        ],
        "bos": "<|begin_of_text|>",
        "eos": ["<|end_of_text|>", "<|eot_id|>"],
        # The chat template ends turns with <|eot_id|>, so that is what
        # ``tokenizer.eos_token`` should report (as Llama 3 Instruct does).
        "eos_token": "<|eot_id|>",
        "pad": None,
        "add_bos": True,
        "split": _LLAMA3_SPLIT,
        "chat_template": _LLAMA3_CHAT_TEMPLATE,
    },
    "qwen": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        # Qwen never prepends a BOS, but its configs still name <|endoftext|>
        # as bos_token_id; callers get that id, the tokenizer gets no bos.
        "bos": "<|endoftext|>",
        "eos": ["<|im_end|>", "<|endoftext|>"],
        "eos_token": "<|im_end|>",
        "pad": "<|endoftext|>",
        "add_bos": False,
        "split": _QWEN_SPLIT,
        "chat_template": _QWEN_CHAT_TEMPLATE,
    },
}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model still needs a real
tokenizer: the engine measures prompt lengths, stops on end-of-turn tokens and
streams text back to the user one piece at a time. When the weights are random
the answers are nonsense, but the plumbing around them is exercised exactly as
it would be in production, which is the whole point of a synthetic checkpoint.

Language models read text as a sequence of integers. Byte pair encoding starts
from single bytes and repeatedly merges the most frequent adjacent pair into a
new symbol. Common words such as "the", "and", "that", "with" and "from" end up
as single tokens, while rare words are spelled out from smaller pieces. Because
the base alphabet covers every byte, there is no unknown token: any string,
whether it is English, Chinese, source code or an emoji, can be encoded.

Scheduling requests is a balancing act. The server keeps a queue of incoming
prompts, admits as many as the key-value cache can hold, and runs them together
in a single batch. Each step produces one new token for every running sequence.
Sequences that finish release their memory so that waiting requests can start.
Throughput grows with batch size until the accelerator is saturated; latency
grows with it too, so the scheduler has to find a sensible trade-off.

Please remember to write clear commit messages, to run the tests before pushing
and to keep functions short. It is easier to review a change that does one thing
well than a change that does many things at once. Good names are worth more than
long comments, and comments should explain why the code is written the way it is.
"""

_CODE = """\
def attention(query, key, value, mask=None):
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ value


class Request:
    def __init__(self, request_id: str, prompt: list[int], max_tokens: int = 256):
        self.request_id = request_id
        self.prompt = prompt
        self.output: list[int] = []
        self.max_tokens = max_tokens

    def is_finished(self) -> bool:
        return len(self.output) >= self.max_tokens


for i in range(10):
    print(f"step {i}: loss={loss:.4f} lr={lr:.2e}")

import json, os, sys
config = {"hidden_size": 4096, "num_layers": 32, "vocab_size": 128256}
with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
"""

# A little non-English text so some multi-byte characters get merged too.
_MULTILINGUAL = (
    "你好，世界。今天天气很好。我们一起学习语言模型。 Grüße aus München! Ça va très bien, merci.\n"
)

_WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city "
    "community name token model layer tensor batch cache kernel request server stream "
    "memory buffer thread queue index"
).split()


def _corpus_lines(seed: int) -> list[str]:
    """The training corpus: fixed prose and code plus seeded filler lines."""
    rng = random.Random(f"corpus-{seed}")
    lines = (_CORPUS + _CODE + _MULTILINGUAL).splitlines(keepends=True)
    for _ in range(300):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        if rng.random() < 0.5:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ",", "?", "!", ":"]) + "\n")
    for _ in range(100):
        lines.append(
            f"{rng.randint(0, 9999)} + {rng.randint(0, 999)} = {rng.randint(0, 99999)}; "
            f"x[{rng.randint(0, 63)}] = 0x{rng.getrandbits(16):04x}; {rng.uniform(0, 100):.3f}%\n"
        )
    return lines


def _train(
    target_model_size: int, split_regex: str, seed: int, corpus: list[str] | None = None
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learns as many real merges as the corpus allows, up to ``target_model_size`` tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = _pre_tokenizer(split_regex)
    trainer = trainers.BpeTrainer(
        vocab_size=target_model_size,
        min_frequency=0,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus or _corpus_lines(seed), trainer=trainer)
    state = json.loads(tokenizer.to_str())["model"]
    vocab = dict(sorted(state["vocab"].items(), key=lambda kv: kv[1]))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in state["merges"]]
    return vocab, merges


def _extend(
    vocab: dict[str, int], merges: list[tuple[str, str]], target_model_size: int, seed: int
) -> None:
    """Pads vocab/merges in place with synthetic word-like merges up to ``target_model_size``.

    Only ASCII-letter pieces (optionally with the byte-level space marker in
    front) are combined, so the new tokens look like words and can actually be
    produced by the pre-tokenizer rather than being unreachable junk.
    """
    space = "\u0120"  # byte-level symbol for " "

    def is_letters(token: str) -> bool:
        return token.isascii() and token.isalpha()

    heads = [t for t in vocab if is_letters(t.removeprefix(space)) or t == space]
    tails = [t for t in vocab if is_letters(t) and len(t) <= 3]
    rng = random.Random(f"merges-{seed}")
    needed = target_model_size - len(vocab)
    attempts_left = 50 * needed + 10_000
    while len(vocab) < target_model_size:
        attempts_left -= 1
        if attempts_left < 0:
            raise RuntimeError("could not generate enough distinct synthetic merges")
        # Squaring the uniform draw favours early (short) heads; with a uniform
        # pick token length grows with the depth of a random recursive tree.
        head = heads[int(len(heads) * rng.random() ** 2)]
        tail = tails[rng.randrange(len(tails))]
        merged = head + tail
        if len(merged) > 12 or merged in vocab:
            continue
        vocab[merged] = len(vocab)
        merges.append((head, tail))
        heads.append(merged)


def _pre_tokenizer(split_regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def _build(vocab_size: int, style: dict, seed: int, corpus: list[str] | None) -> Tokenizer:
    specials = style["special"]
    target_model_size = vocab_size - len(specials)
    vocab, merges = _train(target_model_size, style["split"], seed, corpus)
    _extend(vocab, merges, target_model_size, seed)

    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(style["split"])
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    if style["add_bos"]:
        bos = style["bos"]
        bos_id = target_model_size + specials.index(bos)
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    else:
        tokenizer.post_processor = byte_level
    # Added after the model vocab so they occupy the highest ids, as in Llama 3 and Qwen.
    tokenizer.add_special_tokens(
        [
            AddedToken(
                t, special=True, normalized=False, single_word=False, lstrip=False, rstrip=False
            )
            for t in specials
        ]
    )
    return tokenizer


def _tokenizer_config(style: dict, tokenizer: Tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in style["special"]
    }
    return {
        # Transformers 5 ignores add_bos/eos_token when tokenizer.json exists
        # (its post-processor decides); older loaders and other engines read them.
        "add_bos_token": style["add_bos"],
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": style["bos"] if style["add_bos"] else None,
        "chat_template": style["chat_template"],
        # Cleaning up spaces (e.g. " ." -> ".") would break exact round-trips.
        "clean_up_tokenization_spaces": False,
        "eos_token": style["eos_token"],
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": style["pad"],
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_tokenizer(
    out_dir: str | Path,
    vocab_size: int,
    style: str = "llama3",
    seed: int = 0,
    corpus: list[str] | None = None,
) -> dict:
    """Writes tokenizer.json and tokenizer_config.json into out_dir. Returns a dict of the ids
    the model config and generation_config need: {"bos_token_id": int,
    "eos_token_id": int | list[int], "pad_token_id": int | None}.

    The total vocabulary, special tokens included, is exactly ``vocab_size``;
    the output is byte-identical for equal ``(vocab_size, style, seed)``. ``corpus``
    (lines of text) replaces the built-in training corpus.
    """
    if style not in STYLES:
        raise ValueError(f"unknown tokenizer style {style!r}; expected one of {sorted(STYLES)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: need at least {MIN_VOCAB_SIZE} "
            "(256 byte symbols + special tokens + some merges)"
        )
    spec = STYLES[style]
    tokenizer = _build(vocab_size, spec, seed, corpus)
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError("tokenizer vocab size does not match the requested size")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = _tokenizer_config(spec, tokenizer)
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )

    def token_id(token: str | None) -> int | None:
        return None if token is None else tokenizer.token_to_id(token)

    return {
        "bos_token_id": token_id(spec["bos"]),
        "eos_token_id": [token_id(t) for t in spec["eos"]],
        "pad_token_id": token_id(spec["pad"]),
    }
