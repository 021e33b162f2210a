"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from pathlib import Path

from tqdm import tqdm

from basis.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

Prompt = str | list[int]


class LLM:
    """LLM(model=DIR, dtype="auto", device="auto", **engine_options)."""

    def __init__(self, model: str | Path, dtype: str = "auto", device: str = "auto", **options):
        self.engine = LLMEngine(
            model, EngineConfig.from_options(dtype=dtype, device=device, **options)
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given.

        All prompts are validated before any is queued: one bad prompt raises
        ValueError and none run.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            list(sampling_params)
            if isinstance(sampling_params, (list, tuple))
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        priorities = priority or [0] * len(prompts)
        requests = [
            self.engine.validate(
                self.engine.make_request(f"offline-{next(self._ids)}", prompt, p, priority=prio)
            )
            for prompt, p, prio in zip(prompts, params, priorities)
        ]
        for request in requests:
            self.engine.add(request)
        request_ids = [request.request_id for request in requests]
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(finished_only=True):
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[i] for i in request_ids]

    def get_stats(self) -> dict:
        return self.engine.get_stats()

    def close(self) -> None:
        """Frees the device memory (weights, KV cache, graphs); generate fails after."""
        self.engine.close()
