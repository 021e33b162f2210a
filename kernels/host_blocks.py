"""Device KV blocks written straight into pinned host memory by a kernel: the
host tier's backups without the copy engine.

A backup through the copy engine (one gather into a device staging buffer,
then a device-to-host copy a block) shares the engine's device-to-host queue
with every step's read-back of its sampled tokens: a step that ends while
128 MiB of a backup are in that queue waits for them. Here a few programs
(`programs`, a small share of the SMs, so the steps running beside keep the
rest) read each block's rows from every layer's cache and store them over the
bus into the host slots themselves (pinned memory is mapped into the device's
address space), with no staging buffer and no copy in the queue.

Layout: `caches` are the layers' views of one allocation, [blocks, *block]
each, a fixed stride apart (`layer_stride`, in elements); `host` is [slots,
layers, *block]. Both are moved as 8-byte words when a block's row allows.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - no Triton: the copy engine's path is used
    triton = None

CHUNK = 1024  # words a program moves per iteration
PROGRAMS = 8  # programs per launch: few, so a backup takes little from the steps beside it


def layer_stride(caches: list[torch.Tensor]) -> int | None:
    """Elements from one layer's cache to the next when every layer's cache is a view
    of one allocation at a fixed distance (the engine's layout), else None."""
    if len(caches) < 2:
        return 0 if caches else None
    first = caches[0]
    step = caches[1].data_ptr() - first.data_ptr()
    if step <= 0 or step % first.element_size():
        return None
    for a, b in zip(caches, caches[1:]):
        same = b.shape == first.shape and b.dtype == first.dtype and b.is_contiguous()
        if not same or b.data_ptr() - a.data_ptr() != step:
            return None
    if not first.is_contiguous():
        return None
    return step // first.element_size()


def _word_dtype(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


if triton is not None:

    @triton.jit
    def _blocks_to_host_kernel(
        cache, host, ids, slots, total, layers, layer_stride, words, chunks,
        ROUNDS: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        # Work item (block i, layer, chunk c), `total` of them; program p takes items
        # p, p + P, ... (ROUNDS of them, the last ones past the end in some programs).
        for k in range(0, ROUNDS):
            item = tl.program_id(0) + k * tl.num_programs(0)
            live = item < total
            item = tl.minimum(item, total - 1)
            c = item % chunks
            rest = item // chunks
            layer = (rest % layers).to(tl.int64)
            i = rest // layers
            block = tl.load(ids + i).to(tl.int64)
            slot = tl.load(slots + i).to(tl.int64)
            offs = c * CHUNK + tl.arange(0, CHUNK)
            mask = (offs < words) & live
            rows = tl.load(cache + layer * layer_stride + block * words + offs, mask=mask)
            tl.store(host + (slot * layers + layer) * words + offs, rows, mask=mask)


def usable(caches: list[torch.Tensor], host: torch.Tensor) -> bool:
    """Whether `blocks_to_host` can serve these caches and this host memory."""
    return triton is not None and layer_stride(caches) is not None and host.is_contiguous()


def blocks_to_host(
    caches: list[torch.Tensor],
    host: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    programs: int = PROGRAMS,
) -> None:
    """host[slots[i], layer] = caches[layer][ids[i]] for every layer, on the current
    stream, by `programs` programs; `ids` and `slots` are int64 on the caches' device.
    Returns at once (the stores land when the stream gets there)."""
    if triton is None:
        raise RuntimeError("blocks_to_host needs Triton")
    stride = layer_stride(caches)
    if stride is None:
        raise ValueError("the layers' caches are not views of one allocation a fixed step apart")
    layers = len(caches)
    first = caches[0]
    if host.dtype != first.dtype or tuple(host.shape[1:]) != (layers, *first.shape[1:]):
        raise ValueError(
            f"host slots {host.dtype}{tuple(host.shape[1:])} do not hold "
            f"{layers} layers of {first.dtype}{tuple(first.shape[1:])}"
        )
    if len(ids) != len(slots):
        raise ValueError(f"{len(ids)} block ids for {len(slots)} slots")
    if not len(ids):
        return
    row_bytes = first[0].numel() * first.element_size()
    word = _word_dtype(row_bytes, first, host)
    stride = stride * first.element_size() // word.itemsize  # a layer holds whole rows
    words = row_bytes // word.itemsize
    src = first.view(-1).view(word)
    dst = host.view(-1).view(word)
    chunks = triton.cdiv(words, CHUNK)
    total = len(ids) * layers * chunks
    # a power of two of rounds (few compiled variants), as few programs as cover them
    rounds = triton.next_power_of_2(triton.cdiv(total, max(1, programs)))
    grid = triton.cdiv(total, rounds)
    _blocks_to_host_kernel[(grid,)](
        src, dst, ids, slots, total, layers, stride, words, chunks, ROUNDS=rounds, CHUNK=CHUNK
    )
