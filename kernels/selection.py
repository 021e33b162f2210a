"""Dynamic kernel selection.

Each operator offers variants (different kernels) and, for each, launch
configs (block sizes, warps, stages, splits). For every shape bucket on every
device the fastest (variant, config) is found by timing the candidates on the
first real call, then remembered in an on-disk cache keyed by device name and
Triton version, so later processes start with the choice already made. The
choice made is logged at DEBUG level on the `yinian.kernels` logger.

Tuning never happens during CUDA graph capture (the engine warms every
captured shape up first) nor on CPU, where the first candidate is used.

An operator may limit a variant to the devices that can run it (`supported`),
and may ask that, while tuning, every candidate's output be checked against
the first candidate's (`verify`): a candidate that disagrees is dropped with a
warning, so the tuner never picks a fast but wrong kernel.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.selection_verify import snapshot

logger = logging.getLogger("yinian.kernels")
SLEEP_CYCLES_PER_S = 2.0e9  # torch.cuda._sleep counts GPU clock cycles (~2 GHz on Hopper)


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:  # pragma: no cover - triton ships with CUDA torch
        return "none"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_name(index)
    return device.type


@functools.cache
def _cuda_name(index: int) -> str:
    # asked on every kernel call: torch's lookup costs microseconds a time, and a
    # device's name does not change
    return torch.cuda.get_device_name(index)


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "yinian" / "kernels"
    return Path(os.environ.get("YINIAN_KERNEL_CACHE", default))


# Choices tuned on devices we ran, shipped with the package (as the on-disk cache's
# files: kernels/tuned/<device>__triton-<version>.json), so that a fresh machine with
# such a device compiles only the chosen configurations instead of tuning every
# candidate. Its own cache's choices come first; YINIAN_KERNEL_SHIPPED=0 ignores these.
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"
SELECTORS: list[Selector] = []  # every operator's selector, as its module defines it


def cache_file_name(device: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in device)
    return f"{safe}__triton-{triton_version()}.json"


def shipped_choices(device: str) -> dict[str, dict[str, dict]]:
    """{op: {bucket: choice}} shipped for this device and Triton version ({} if none)."""
    if os.environ.get("YINIAN_KERNEL_SHIPPED", "1") == "0":
        return {}
    path = SHIPPED_DIR / cache_file_name(device)
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        logger.warning("ignoring unreadable shipped kernel choices %s", path)
        return {}


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True, slots=True)
class Candidate:
    variant: str
    config: tuple[tuple[str, object], ...] = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.config)

    def to_json(self) -> dict:
        return {"variant": self.variant, "config": dict(self.config)}

    @classmethod
    def from_json(cls, data: dict) -> Candidate:
        return cls(data["variant"], tuple(sorted(data.get("config", {}).items())))


class _DiskCache:
    """One JSON file per (device, Triton version): {op: {bucket: candidate}}."""

    _lock = threading.Lock()

    def __init__(self, device: str):
        self.path = cache_dir() / cache_file_name(device)
        self._held = threading.local()  # this thread's depth inside `exclusive`
        self.data = shipped_choices(device)  # under what this machine chose itself
        self.reload()

    def reload(self) -> None:
        """Merges in what other processes wrote since (they may have tuned meanwhile)."""
        if not self.path.is_file():
            return
        try:
            disk = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            logger.warning("ignoring unreadable kernel cache %s", self.path)
            return
        with self._lock:
            for op, buckets in disk.items():
                self.data.setdefault(op, {}).update(buckets)

    @contextlib.contextmanager
    def exclusive(self):
        """Holds the cache's lock file: one process of a machine tunes a bucket, the
        others wait and take its choice, so workers sharing a device (a prefill and
        a decode worker) run the same kernel configurations and agree bit for bit.
        Re-entrant in a thread: a candidate that calls another operator whose bucket
        is not tuned yet (a shared expert's SiLU inside a MoE candidate) tunes it
        under the lock it holds (a second flock on a new handle would wait forever
        on its own process)."""
        if getattr(self._held, "depth", 0):
            self._held.depth += 1
            try:
                yield
            finally:
                self._held.depth -= 1
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path.with_suffix(".lock"), "a+")
        except OSError:
            yield
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            self._held.depth = 1
            try:
                yield
            finally:
                self._held.depth = 0
                fcntl.flock(handle, fcntl.LOCK_UN)

    def get(self, op: str, bucket: str) -> Candidate | None:
        entry = self.data.get(op, {}).get(bucket)
        return Candidate.from_json(entry) if entry else None

    def put(self, op: str, bucket: str, candidate: Candidate, ms: float) -> None:
        with self._lock:
            self.data.setdefault(op, {})[bucket] = dict(candidate.to_json(), ms=ms)
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
                tmp.replace(self.path)
            except OSError as exc:  # a read-only home still runs, just re-tunes next time
                logger.warning("cannot write kernel cache %s: %s", self.path, exc)


_CACHES: dict[str, _DiskCache] = {}


def _disk_cache(device: str) -> _DiskCache:
    if device not in _CACHES:
        _CACHES[device] = _DiskCache(device)
    return _CACHES[device]


def cuda_timer(fn: Callable[[], object], warmup: int = 2, reps: int = 7,
               sample_ms: float = 0.5) -> float:  # fmt: skip
    """Median GPU milliseconds of one call of `fn`, from CUDA events. Each sample times
    enough back-to-back calls to fill about `sample_ms`, queued while the GPU is held
    busy (torch.cuda._sleep), so they run without gaps: the host's launch cost, which
    would otherwise decide the time of short kernels on a busy host, stays out."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    host_s = time.perf_counter() - began  # queueing one call (the GPU may still run it)

    def sample(calls: int) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        if hasattr(torch.cuda, "_sleep"):  # long enough for the host to queue every call
            torch.cuda._sleep(int((2 * calls * host_s + 1e-4) * SLEEP_CYCLES_PER_S))
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    calls = max(1, min(64, math.ceil(sample_ms / max(sample(1), 1e-3))))
    times = sorted(sample(calls) for _ in range(reps))
    return times[len(times) // 2]


def cold_cuda_timer(fn: Callable[[], object], warmup: int = 2, reps: int = 15) -> float:
    """Median GPU milliseconds of one call of `fn` whose inputs are not in the L2 cache,
    for kernels that stream a weight read once a step (a decode step reads every layer's
    weights: none is still cached when its layer comes round). Back to back, a weight of
    up to the L2's size (50 MB on Hopper; a 4096 x 4096 bf16 projection is 33.5 MB) is
    read from the cache, and the choice favours whatever wins at cache speed. Before each
    timed call a buffer of twice the L2's size is read (not written: the cache is left
    holding clean lines, as after a step's earlier weight reads, with no write-backs to
    slow the timed call). Each call is timed alone between two events; the calls are
    queued while the GPU is held busy, so the host's launch cost stays out."""
    device = torch.device("cuda", torch.cuda.current_device())
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    try:
        flush = torch.zeros(2 * l2 // 4, dtype=torch.int32, device=device)
    except torch.cuda.OutOfMemoryError:  # a full device (the KV cache made first): time hot
        logger.warning("no room for a %d MB buffer to empty the L2 cache: timed back to back",
                       2 * l2 >> 20)  # fmt: skip
        return cuda_timer(fn, warmup=warmup, reps=reps)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    flush.sum()
    fn()
    host_s = time.perf_counter() - began
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]  # fmt: skip
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int((2 * reps * host_s + 1e-4) * SLEEP_CYCLES_PER_S))
    for start, end in pairs:
        flush.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in pairs)
    return times[len(times) // 2]


class Selector:
    """Chooses and calls one operator's best (variant, config) for each shape bucket.

    variants: name -> callable(*args, **config); configs: name -> list of config dicts
    (an empty list means the variant takes no config); bucket: (*args) -> hashable
    description of the shape class the choice is valid for.
    supported: name -> callable(device) -> bool, for variants only some devices can run
    (the others are never tuned nor chosen there; the first variant must run anywhere).
    verify: callable(reference_output, output) -> None when the output is acceptable,
    else a short reason; when given, tuning checks each candidate's output against the
    output of the first candidate that ran (see selection_verify.close_outputs) and drops those that
    disagree or raise. applies: callable(config, *args) -> bool, the configs that suit these
    inputs (one the shape would turn into another's duplicate is never tuned nor chosen for
    them; the first config must suit every input; a dict holds one such rule a variant, and
    a variant it does not name suits every input). revision: bumped when the candidates
    change enough that choices already on disk should be made again (it is part of the
    on-disk key).
    """

    def __init__(
        self,
        op: str,
        variants: dict[str, Callable],
        configs: dict[str, list[dict]],
        bucket: Callable[..., tuple],
        timer: Callable[[Callable[[], object]], float] = cuda_timer,
        tune_on_cpu: bool = False,
        supported: dict[str, Callable[[torch.device], bool]] | None = None,
        verify: Callable[[object, object], str | None] | None = None,
        applies: Callable[..., bool] | dict[str, Callable[..., bool]] | None = None,
        revision: str = "",
        tune_args: Callable[[tuple], tuple] | None = None,
    ):
        self.op = op
        self.variants = variants
        self.bucket = bucket
        self.timer = timer
        self.tune_on_cpu = tune_on_cpu
        self.supported = supported or {}
        self.verify = verify
        self.applies = applies
        self.tune_args = tune_args
        self.cache_key = f"{op}@{revision}" if revision else op
        self.candidates = [
            Candidate(name, tuple(sorted(cfg.items())))
            for name in variants
            for cfg in (configs.get(name) or [{}])
        ]
        self._memo: dict[tuple[str, str], Candidate] = {}
        self._usable: dict[str, list[Candidate]] = {}
        SELECTORS.append(self)

    def usable(self, device: torch.device) -> list[Candidate]:
        """The candidates whose variant this device supports, in declaration order."""
        key = str(device)
        if key not in self._usable:
            ok = {}
            for name in self.variants:
                try:
                    ok[name] = (
                        bool(self.supported[name](device)) if name in self.supported else True
                    )
                except Exception as exc:  # a probe that fails means "not here"
                    logger.debug(
                        "kernel %s variant %s unsupported on %s: %s", self.op, name, key, exc
                    )
                    ok[name] = False
            self._usable[key] = [c for c in self.candidates if ok[c.variant]]
            if not self._usable[key]:
                raise RuntimeError(f"no variant of kernel {self.op} supports {key}")
        return self._usable[key]

    def suiting(self, candidates: list[Candidate], args: tuple) -> list[Candidate]:
        """The candidates whose config suits these inputs (see `applies`)."""
        if self.applies is None:
            return candidates
        suiting = [c for c in candidates if self._suits(c, args)]
        if not suiting or suiting[0] != candidates[0]:  # the default and verify's reference
            raise ValueError(f"kernel {self.op}: its first config must suit every input")
        return suiting

    def _suits(self, candidate: Candidate, args: tuple) -> bool:
        rule = self.applies
        if isinstance(rule, dict):
            rule = rule.get(candidate.variant)
        return rule is None or bool(rule(candidate.kwargs, *args))

    def __call__(self, *args):
        candidate = self.choose(*args)
        return self.variants[candidate.variant](*args, **candidate.kwargs)

    def choose(self, *args) -> Candidate:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        dev = device_name(device)
        bucket = repr(self.bucket(*args))
        key = (dev, bucket)
        found = self._memo.get(key)
        if found is not None:
            return found
        candidates = self.suiting(self.usable(device), args)
        cache = _disk_cache(dev)
        found = cache.get(self.cache_key, bucket)
        how = "cached"
        if found is None or found not in candidates:
            tunable = device.type == "cuda" or self.tune_on_cpu
            if not tunable or _capturing(device):
                found, how = candidates[0], "default"
            else:
                with cache.exclusive():
                    cache.reload()
                    found = cache.get(self.cache_key, bucket)
                    if found is not None and found in candidates:
                        how = "cached by another process"
                    else:
                        began = time.monotonic()
                        found, ms = self.tune(args, candidates)
                        cache.put(self.cache_key, bucket, found, ms)
                        how = f"tuned, {ms:.4f} ms"
                        # rare and slow (every candidate compiled and timed, while the
                        # caller waits): worth a line where a slow first request is read
                        logger.info(
                            "kernel tuned: %s bucket %s -> %s %s in %.2f s",
                            self.op, bucket, found.variant, found.kwargs,
                            time.monotonic() - began,
                        )  # fmt: skip
        self._memo[key] = found
        logger.debug(
            "kernel %s on %s bucket %s -> %s %s (%s)",
            self.op,
            dev,
            bucket,
            found.variant,
            found.kwargs,
            how,
        )
        return found

    def tune(
        self, args: tuple, candidates: list[Candidate] | None = None, report: dict | None = None
    ) -> tuple[Candidate, float]:
        """The fastest of `candidates` (default: all this device supports) on these inputs,
        and its time in ms. report, if given, maps each candidate to its ms or to why it
        was dropped (it raised, or verify rejected its output)."""
        if candidates is None:
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            candidates = self.suiting(self.usable(device), args)
        report = {} if report is None else report
        if self.tune_args is not None:
            args = self.tune_args(args)
        best, best_ms = None, float("inf")
        reference, reference_candidate = None, None
        for candidate in candidates:
            fn = self.variants[candidate.variant]
            kwargs = candidate.kwargs

            def run(fn=fn, kwargs=kwargs):
                return fn(*args, **kwargs)

            try:
                if self.verify is not None:
                    output = run()
                    if reference_candidate is None:
                        reference, reference_candidate = snapshot(output), candidate
                    else:
                        problem = self.verify(reference, output)
                        if problem is not None:
                            logger.warning(
                                "kernel %s candidate %s %s disagrees with %s %s (%s): dropped",
                                self.op, candidate.variant, candidate.kwargs,
                                reference_candidate.variant, reference_candidate.kwargs, problem,
                            )  # fmt: skip
                            report[candidate] = f"wrong output: {problem}"
                            continue
                ms = self.timer(run)
            except Exception as exc:  # a config the device cannot run (resources) is skipped
                logger.debug("kernel %s candidate %s failed: %s", self.op, candidate, exc)
                report[candidate] = f"failed: {type(exc).__name__}: {exc}"[:500]
                continue
            report[candidate] = ms
            if ms < best_ms:
                best, best_ms = candidate, ms
        if best is None:
            raise RuntimeError(f"no candidate of kernel {self.op} ran for these inputs")
        return best, best_ms


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
