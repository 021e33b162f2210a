"""One request as the engine takes it: its id, prompt ids, sampling parameters,
scheduling priority and where its KV may be shared.

Every way in builds this one type (`LLMEngine.make_request` from a prompt, a
worker service from its wire message in `services/worker/wire.py`), and the
engine validates it once: `LLMEngine.validate` returns it marked, and the
engine's entry points check only a request not marked yet. No torch here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from basis.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first
    namespace: str = ""  # its tenant: equal prefixes share KV only within one
    public_tokens: int = 0  # leading tokens of an operator's public prefix (every tenant's)
    prompt: str | None = None  # the text, when it came as text
    # set by LLMEngine.validate only (not an argument: no caller can claim it)
    validated: bool = field(default=False, init=False, compare=False)

    def replace(self, **changes) -> EngineRequest:
        """A copy with `changes`, not marked: it is validated again where it goes in."""
        return dataclasses.replace(self, **changes)

    def marked_valid(self) -> EngineRequest:
        """A copy marked valid (LLMEngine.validate's answer)."""
        copy = dataclasses.replace(self)
        object.__setattr__(copy, "validated", True)  # frozen: the one place it is set
        return copy
