"""The model folder's tokenizer: encoding, chat templates and streaming decode.

Loads `tokenizer.json` with the `tokenizers` library and the chat template
from `tokenizer_config.json`, rendered by a sandboxed jinja2 environment the
way Hugging Face renders it. A folder without tokenizer files has no
Tokenizer: such a model serves token-id prompts only.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As Hugging Face renders templates: keys in their order and no HTML escaping
    # (jinja's own tojson sorts keys and escapes <, >, & for HTML).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _special(value):
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict):
        self._tok = tokenizer
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _special(config.get("bos_token"))
        self.eos_token = _special(config.get("eos_token"))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._template = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer | None:
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_file = folder / "chat_template.jinja"
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text()
        return cls(HFTokenizer.from_file(str(path)), config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call lets go of the GIL while it works (the single one holds it): a
        # long text tokenized in a thread leaves the caller's other threads running
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token's text takes (special tokens included): a
        text of n characters is at least n / max_token_bytes tokens long."""
        texts = self._tok.decode_batch([[i] for i in range(self.vocab_size)],
                                       skip_special_tokens=False)  # fmt: skip
        return max((len(t.encode()) for t in texts), default=1) or 1

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> list[int]:
        # The template writes the special tokens itself; adding them again would double BOS.
        extra = {"tools": tools} if tools else {}
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )
        return self.encode(text, add_special_tokens=False)

    def stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self._tok, skip_special_tokens)


class IncrementalDecoder:
    """Text of a growing token sequence, released only as whole UTF-8 characters."""

    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool):
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tok, token_id) or ""
        except Exception:  # an id the tokenizer does not know decodes to nothing
            return ""
