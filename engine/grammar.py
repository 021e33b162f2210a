"""Structured outputs in the engine: grammars compiled once per specification,
one matcher per sequence, and the token bitmask the sampler applies.

`GrammarCompiler` turns a `StructuredOutput` into an llguidance matcher over
the model's tokenizer and keeps the compiled matcher per specification;
every sequence gets a copy (`SequenceGrammar`), advanced by each token it
accepts. A step's bitmask rows are computed on the host once the step's
forward pass and logits are queued (`MaskJob.result`, called by the sampler),
all rows in one call to llguidance's executor, which fills them in parallel on
its own threads (no Python loop per row): on CUDA the device runs the step
meanwhile, so the masks cost no step time; then they move to the device and
are applied there. (Computing them before the forward pass is queued would not
help on CPU: they would take cores from it.)

With async scheduling a constrained sequence's next step is queued before its
token is read back (`ahead`: the step and row that sampled it): the next step's
mask job first reads those tokens (waiting for that step only, while the device
runs the next forward pass) and advances every matcher by its token in one
parallel call (`catch_up`), keeping each verdict; the output processor's
`accept` of the same token then takes it. The rows are then filled on the
mask thread (`MaskJob.start`) while the engine applies the step before and
schedules the next; the sampler applies them when the next step is launched.
Preemption keeps a sequence's generated tokens, so its matcher stays in step;
siblings of an n > 1 request each start from the compiled matcher.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from basis.structured_output import StructuredOutput
from kernels.token_mask import apply_token_bitmask_

_MAX_COMPILED = 256


class SequenceGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher, words: int):
        self.matcher = matcher
        self.words = words  # int32 words of its bitmask row
        # a step queued ahead sampled its next token: (that step's sample, its row)
        self.ahead: tuple[object, int] | None = None
        # caught up, not yet accepted: (token, allowed, stopped after it, the error if not allowed)
        self._early: deque[tuple[int, bool, bool, str]] = deque()
        self._after: tuple[bool, str] | None = None  # (stopped, error) after the last early token

    def fill(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into `row` (int32, one bit per token)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def caught_up(self, token: int, allowed: bool) -> None:
        """`token` was consumed ahead of its `accept` (catch_up): keeps its verdict and
        what `terminated` and `error` say after it, so that `accept` touches no
        matcher while the mask thread fills this one."""
        self.ahead = None
        matcher = self.matcher
        self._early.append(
            (token, allowed, matcher.is_stopped(), "" if allowed else matcher.get_error())
        )

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the grammar does not allow it. The
        token `catch_up` consumed already is not consumed twice."""
        if self._early:
            token, allowed, stopped, error = self._early.popleft()
            if token != token_id:
                raise RuntimeError(f"grammar caught up on token {token}, then given {token_id}")
            self._after = (stopped, error)
            return allowed
        self.ahead = None
        self._after = None
        return self.matcher.consume_token(token_id)

    @property
    def terminated(self) -> bool:
        """The output is complete: no token but end-of-sequence could follow."""
        return self._after[0] if self._after is not None else self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._after[1] if self._after is not None else self.matcher.get_error()


class GrammarCompiler:
    """Compiled matchers per specification, over one tokenizer. Thread-safe:
    requests are validated outside the engine's thread."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids):
        from llguidance import LLTokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError("structured outputs need the model's tokenizer (tokenizer.json)")
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._tokenizer = LLTokenizer(
            path.read_text(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def compiled(self, spec: StructuredOutput):
        """The matcher at the start of `spec`'s grammar, compiled on first use;
        ValueError if the grammar is invalid for this tokenizer."""
        from llguidance import LLMatcher

        with self._lock:
            matcher = self._compiled.get(spec.key)
            if matcher is not None:
                self._compiled.move_to_end(spec.key)
                return matcher
        matcher = LLMatcher(self._tokenizer, spec.grammar(), log_level=0)
        if matcher.is_error():
            error = matcher.get_error()
            raise ValueError(f"invalid {spec.kind} for structured output: {error}")
        with self._lock:
            self._compiled[spec.key] = matcher
            if len(self._compiled) > _MAX_COMPILED:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, spec: StructuredOutput) -> None:
        """ValueError unless the grammar compiles and its consumed tokens fit it."""
        if spec.consumed:
            self.start(spec)
        else:
            self.compiled(spec)

    def start(self, spec: StructuredOutput) -> SequenceGrammar:
        """A new sequence's grammar, past the tokens `spec` says were generated already."""
        grammar = SequenceGrammar(self.compiled(spec).deep_copy(), self.words)
        for token in spec.consumed:
            if not grammar.accept(token):
                raise ValueError("the resumed tokens do not match the structured output")
        return grammar


_EXECUTOR: list = []  # llguidance's LLExecutor (its thread pool), made on first use
_EXECUTOR_LOCK = threading.Lock()
# fills a step's rows while the engine goes on (llguidance releases the GIL meanwhile)
_MASK_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")


def _executor():
    from llguidance import LLExecutor

    if not _EXECUTOR:
        _EXECUTOR.append(LLExecutor())
    return _EXECUTOR[0]


def _fill_all(grammars: list[SequenceGrammar], bitmask: np.ndarray) -> None:
    """Every row of `bitmask` from its grammar, in one call to llguidance's executor."""
    with _EXECUTOR_LOCK:  # engines of one process share its thread pool
        _executor().unsafe_compute_mask_ptr(
            [(g.matcher, i) for i, g in enumerate(grammars)],
            bitmask.ctypes.data,
            bitmask.shape[1] * bitmask.itemsize,
            bitmask.shape[0],
        )


def catch_up(grammars: list[SequenceGrammar]) -> bool:
    """Advances each grammar whose last token a step queued ahead sampled past that
    token (read back for it: waits for that step), all in one parallel call; True if
    any was."""
    due = [g for g in grammars if g.ahead is not None]
    if not due:
        return False
    try:
        tokens = [sample.token_ids()[row] for sample, row in (g.ahead for g in due)]
    except Exception:  # noqa: BLE001 - that step failed: its sequences end with its error
        for grammar in due:
            grammar.ahead = None
        return False
    if len(due) == 1:
        verdicts = [due[0].matcher.consume_token(tokens[0])]
    else:
        with _EXECUTOR_LOCK:
            verdicts = _executor().consume_token_par([(g.matcher, t) for g, t in zip(due, tokens)])
    for grammar, token, allowed in zip(due, tokens, verdicts):
        grammar.caught_up(token, allowed)
    return True


class MaskJob:
    """The bitmask rows of one step's constrained sequences, filled on first use, or
    on the mask thread once `start` caught them up."""

    def __init__(self, rows: list[int], grammars: list[SequenceGrammar], pinned: bool = False):
        self.rows = rows  # which of the step's sampled sequences are constrained
        self._grammars = grammars
        # llguidance writes the rows straight into this (in pinned memory for a CUDA
        # step: it moves to the device without a copy on the host first)
        self.tensor = torch.empty((len(grammars), grammars[0].words), dtype=torch.int32,
                                  pin_memory=pinned)  # fmt: skip
        self._bitmask: np.ndarray | None = None
        self._filling: Future | None = None
        self.fill_seconds = 0.0  # the host time filling the rows took (not the catch-up)

    @property
    def filled(self) -> bool:
        return self._bitmask is not None

    def start(self) -> bool:
        """Catches the grammars up past the tokens of the step queued before this one
        and, if there were any (that step ran ahead), starts filling the rows on the
        mask thread: True then, and `result()` waits for them."""
        if self._bitmask is not None or self._filling is not None:
            return self._filling is not None
        if not catch_up(self._grammars):
            return False
        # Waits until the mask thread runs: a thread that asks for the GIL while this one
        # runs Python gets it only after the interpreter's switch interval (5 ms), so the
        # fill would start when the engine next blocks, by then waiting for the masks.
        # The mask thread gives the GIL back once llguidance fills the rows.
        started = threading.Event()

        def fill() -> np.ndarray:
            started.set()
            return self._fill()

        self._filling = _MASK_THREAD.submit(fill)
        started.wait()
        return True

    def result(self) -> np.ndarray:
        if self._bitmask is None:
            if self._filling is not None:
                self._bitmask = self._filling.result()
                self._filling = None
            else:
                catch_up(self._grammars)
                self._bitmask = self._fill()
        return self._bitmask

    def _fill(self) -> np.ndarray:
        start = time.perf_counter()
        grammars = self._grammars
        bitmask = self.tensor.numpy()
        if len(grammars) == 1:
            grammars[0].fill(bitmask[0])
        else:
            _fill_all(grammars, bitmask)
        self.fill_seconds = time.perf_counter() - start
        return bitmask


def masks_for(seqs, device: torch.device | None = None) -> MaskJob | None:
    """The masks the constrained sequences among `seqs` need (None: none is), for a
    step on `device`."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return None
    pinned = device is not None and device.type == "cuda"
    return MaskJob(rows, [seqs[i].grammar for i in rows], pinned)


def apply_masks(logits: torch.Tensor, job: MaskJob, rows: torch.Tensor) -> None:
    """Sets the logits of every token a row's grammar forbids to -inf, on the device
    (`rows`: which logits row each bitmask row is for), once the rows are filled."""
    job.result()
    bitmask = job.tensor
    if logits.is_cuda:  # from pinned memory: queued, the host goes on
        bitmask = bitmask.to(logits.device, non_blocking=True)
    apply_token_bitmask_(logits, bitmask, rows)
