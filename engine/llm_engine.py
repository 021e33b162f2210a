"""The step-level engine services build on: add a request, run one step,
abort a request, read statistics and KV events.

`add` validates a request (once: `validate` marks it) before it changes any
state, so a bad request is a ValueError for its caller only. A step that fails
finishes the requests in it with an error and leaves the engine serving the
rest.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from basis.model_config import ModelConfig
from basis.sampling_params import SamplingParams
from basis.text_stream import TextStream
from basis.tokenizer import Tokenizer
from engine.block_pool import KVEvents
from engine.config import EngineConfig
from engine.disaggregation import Disaggregation, Reservation
from engine.facts import EngineFacts
from engine.grammar import GrammarCompiler
from engine.host_memory_ahead import HostMemoryAhead
from engine.kv_cache_manager import KVCacheManager
from engine.kv_tiers import KVTiers
from engine.mock_runner import MockRunner
from engine.model_runner import ModelRunner
from engine.output_processor import RequestState, make_output
from engine.outputs import RequestMetrics, RequestOutput
from engine.request import EngineRequest
from engine.request_checks import check_request, tokenize
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence
from engine.speculative import Drafter
from engine.startup import StartupPhases
from engine.stats import engine_stats
from engine.step_timing import StepTiming
from engine.stepping import Stepper

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None):
        self.startup = StartupPhases()  # where its start-up went, by phase
        self.config = config or EngineConfig()
        self.model_dir = Path(model)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.max_model_len = self.model_config.context_length(self.config.max_model_len)
        if (
            not self.config.enable_chunked_prefill
            and self.config.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len})"
            )
        self.startup.mark("config")
        ahead = HostMemoryAhead(self.config)
        if self.config.model_runner == "mock":  # no warm-up to overlap: the tiers allocate
            self.runner = MockRunner(self.model_config, self.config, self.model_dir)
        else:
            self.runner = ModelRunner(self.model_config, self.config, self.model_dir, ahead)
        if hasattr(self.runner, "startup"):
            self.startup.take(self.runner.startup)
        self.kv = KVCacheManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.config, self.kv, self.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self.disagg = Disaggregation(self.kv, self.scheduler, self.runner.kv_caches)
        self.tiers = KVTiers(self.config, self.runner.kv_caches, self.kv, ahead)
        self.startup.mark("host tier" if self.tiers.host is not None else "engine")
        cache = self.runner.kv_caches[0]
        self.facts = EngineFacts(
            block_size=self.config.block_size,
            num_layers=self.model_config.num_hidden_layers,
            num_kv_blocks=self.runner.num_blocks,
            max_num_seqs=self.config.max_num_seqs,
            device=self.runner.device,
            kv_dtype=cache.dtype,
            kv_block_shape=tuple(cache.shape[1:]),
            kv_block_bytes=self.tiers.block_bytes,
            has_host_tier=self.tiers.host is not None,
            tensor_parallel_size=self.config.tensor_parallel_size,
            pipeline_parallel_size=self.config.pipeline_parallel_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
        )
        eos = set(self.model_config.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        async_scheduling = self.config.async_scheduling
        if async_scheduling is None:  # default: on where the device runs apart
            # (a mock on a GPU's profile models the GPU, running apart as well)
            mock_gpu = self.config.mock_device is not None
            async_scheduling = self.runner.device.type == "cuda" or mock_gpu
        drafter = None
        if self.config.speculative_method is not None:  # steps then never run ahead
            drafter = Drafter(self.config.speculative_method, self.config.num_speculative_tokens,
                              self.config.prompt_lookup_min, self.config.prompt_lookup_max,
                              self.max_model_len, self.runner.mtp_drafts)  # fmt: skip
        self.timing = StepTiming(self.runner.device.type == "cuda")
        self.stepper = Stepper(
            self.scheduler, self.runner, self.kv, self.tiers, self.disagg, self.timing,
            self.requests, async_scheduling=async_scheduling,
            pipeline_depth=self.config.pipeline_parallel_size, max_model_len=self.max_model_len,
            drafter=drafter,
        )  # fmt: skip
        self._grammars: GrammarCompiler | None = None  # made by the first structured output

    # -- requests ------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(self.tokenizer, prompt)

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        namespace: str = "",
        public_tokens: int = 0,
    ) -> EngineRequest:
        """The request for a prompt (text is tokenized here); not validated yet."""
        return EngineRequest(
            request_id,
            self.tokenize(prompt),
            params if params is not None else SamplingParams(),
            priority,
            namespace,
            public_tokens,
            prompt=prompt if isinstance(prompt, str) else None,
        )

    def validate(self, request: EngineRequest) -> EngineRequest:
        """Every check a request must pass: the request marked valid, or a ValueError
        (nothing changes). A request marked already is not checked again."""
        if request.validated:
            return request
        params = request.params
        check_request(
            request.prompt_ids,
            params,
            self.model_config,
            self.max_model_len,
            self.tokenizer,
            self.kv,
        )
        if params.n > self.config.max_num_seqs:  # its outputs could never run together
            raise ValueError(
                f"n ({params.n}) must not exceed the engine's max_num_seqs "
                f"({self.config.max_num_seqs})"
            )
        if params.structured_output is not None:
            self.grammars.check(params.structured_output)
        return request.marked_valid()

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiled grammars over this model's tokenizer."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.model_dir, self.model_config.vocab_size, self.eos_token_ids
            )
        return self._grammars

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        delta: bool = False,
        handoff=None,
        hold_seconds: float | None = None,
        **fields,
    ) -> None:
        """Queues a prompt: `add` of `make_request` (`fields`: priority, namespace,
        public_tokens)."""
        request = self.make_request(request_id, prompt, params, **fields)
        self.add(request, delta=delta, handoff=handoff, hold_seconds=hold_seconds)

    def add(
        self,
        request: EngineRequest,
        *,
        delta: bool = False,
        handoff=None,
        hold_seconds: float | None = None,
    ) -> None:
        """Queues a request, validated here unless it is already.
        With `delta`, each output carries only the tokens and text new since the last.
        Prefill role: `handoff` sends the prompt's KV out layer by layer, and
        `hold_seconds` keeps the blocks after the request finishes (see disaggregation)."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        request = self._admit(request)
        request_id = request.request_id
        if handoff is not None and request.params.n != 1:
            raise ValueError("a request handed off to another worker must have n == 1")
        arrival = time.monotonic()
        seqs = [self._new_sequence(request, i, arrival) for i in range(request.params.n)]
        for child in seqs[1:]:
            child.fork_parent = seqs[0]
        self.requests[request_id] = RequestState(
            request_id=request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_ids,
            seqs=seqs,
            metrics=RequestMetrics(arrival_time=arrival),
            delta=delta,
            hold_seconds=hold_seconds,
        )
        seqs[0].handoff = handoff
        for seq in seqs:
            seq.hold_blocks = hold_seconds is not None
            self.scheduler.add(seq)

    def _admit(self, request: EngineRequest) -> EngineRequest:
        """The checks every way in makes: an id not in use, the request valid."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        return self.validate(request)

    def _new_sequence(self, request: EngineRequest, index: int, arrival: float) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed + index)
        seq = Sequence(
            seq_id=request.request_id if index == 0 else f"{request.request_id}#{index}",
            request_id=request.request_id,
            index=index,
            prompt_token_ids=request.prompt_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            priority=request.priority,
            arrival_time=arrival,
            namespace=request.namespace,
            public_tokens=request.public_tokens,
            generator=generator,
        )
        wants_text = self.config.detokenize or bool(params.stop)
        seq.text_stream = TextStream(self.tokenizer if wants_text else None, params)
        if params.structured_output is not None:
            seq.grammar = self.grammars.start(params.structured_output)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.disagg.release(request_id)
        if self.disagg.cancel(request_id) is not None:
            self.requests.pop(request_id, None)
            return None
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish(FinishReason.ABORT)
        return make_output(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step would do anything (reserved remote prefills wait outside)."""
        return self.stepper.has_work()

    @property
    def async_scheduling(self) -> bool:
        """Whether a step is read back during the next one (see stepping)."""
        return self.stepper.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        self.stepper.async_scheduling = on

    # -- stepping ------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Runs one batch; returns the output of every request it touched (or, with
        `finished_only`, of those that finished).

        With async scheduling a step is queued on the device and read back during
        the next call, after that call has queued its own step: the host work of
        one step (outputs, scheduling, inputs) overlaps the device work of the
        next. Each sequence's next input token then comes from the device."""
        touched = self.stepper.run()
        return [self._emit(s) for s in touched.values() if s.finished or not finished_only]

    # -- disaggregation (decode role) ------------------------------------------
    def reserve_remote(self, request: EngineRequest, *, delta: bool = False) -> Reservation | None:
        """Makes the request and blocks for its whole prompt, to be filled from
        outside; None when the blocks are not free now (run it locally instead)."""
        request = self._admit(request)
        if request.params.n != 1:
            raise ValueError("remote prefill needs n == 1")
        self.stepper.settle()
        seq = self._new_sequence(request, 0, time.monotonic())
        state = RequestState(
            request.request_id,
            request.prompt,
            request.prompt_ids,
            [seq],
            RequestMetrics(arrival_time=seq.arrival_time),
            delta=delta,
        )
        reservation = self.disagg.reserve(state)
        if reservation is not None:
            self.requests[request.request_id] = state
            # a prefix hit in the host tier: load it now (the rest arrives from outside)
            self.tiers.load_pending(outside_writes=True)
        return reservation

    # -- blocks lent by a KV store on this host (the worker copies them in) ---------
    def import_device_begin(self, hashes: list[int], start: int) -> list[int]:
        """Device blocks held for `hashes[start:]`, to be filled from outside (see
        KVTiers.import_device_begin); a tenth of the pool stays free for running
        sequences."""
        self.stepper.settle()
        ids = self.tiers.import_device_begin(hashes, start, self.kv.pool.num_usable_blocks // 10)
        if ids:
            self.tiers.load_pending(outside_writes=True)  # evicted blocks saved first
        return ids

    def import_device_end(self, block_ids: list[int], hashes: list[int], filled: int) -> None:
        self.tiers.import_device_end(block_ids, hashes, filled)

    def commit_remote(
        self, request_id: str, token_id: int, logprob: float = 0.0, top=None
    ) -> RequestOutput:
        """The reserved blocks are filled: continue with the prefill side's first token."""
        state = self.disagg.commit(request_id, token_id, logprob, top, self.max_model_len)
        return self._emit(state)

    def release_held(self, request_id: str) -> bool:
        """Prefill role: the decode side has the blocks of `request_id`; free them."""
        return self.disagg.release(request_id)

    def expire_held(self) -> list[str]:
        """Prefill role: frees the blocks whose lease ran out; returns their requests."""
        return self.disagg.expire()

    def housekeeping(self) -> bool:
        """Between steps, also when idle: ends expired leases and finished host-tier
        copies. True when blocks were freed."""
        return self.stepper.housekeeping()

    def _emit(self, state: RequestState) -> RequestOutput:
        out = make_output(state)
        if out.finished:
            self.requests.pop(state.request_id, None)
        return out

    # -- what services need of the engine --------------------------------------
    @property
    def kv_caches(self) -> list:
        """One tensor per layer (see kv_cache_spec); what KV transports read and write."""
        return self.runner.kv_caches

    @property
    def closed(self) -> bool:
        return self.runner.model is None

    def close(self) -> None:
        """Ends every request and frees the model, the KV cache and the CUDA graphs."""
        for request_id in list(self.requests):
            self.abort_request(request_id)
        for request_id in list(self.disagg.held):
            self.disagg.release(request_id)
        self.stepper.drop()
        self.tiers.close()
        self.runner.close()

    # -- reporting -----------------------------------------------------------
    def get_stats(self) -> dict:
        stats = engine_stats(self.scheduler, self.kv, self.runner, self.tiers.host)
        if self.stepper.drafter is not None:
            stats |= self.stepper.drafter.stats.as_dict()
        return stats | self.timing.stats()

    def drain_kv_events(self) -> KVEvents:
        return self.tiers.drain_events()
