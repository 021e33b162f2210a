"""Device blocks stored straight into host slots by a kernel (kernels/host_blocks.py,
the host tier's backups on CUDA), through Triton's interpreter here: every layer of
exactly the chosen blocks lands in exactly the chosen slots, byte for byte, at odd
shapes and dtypes, however few programs share the work; caches that are not one
allocation's layers, or slots of another shape, are refused before anything moves."""

from __future__ import annotations

import pytest
import torch

from kernels.host_blocks import blocks_to_host, layer_stride, usable


def _caches(dtype, layers=3, blocks=7, block=(2, 3, 1, 5)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(layers * blocks)
    full = (torch.randn((layers, blocks, *block), generator=g) * 50).to(dtype)
    return list(full.unbind(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("programs", [1, 3, 64])
def test_chosen_blocks_land_in_chosen_slots(dtype, programs):
    caches = _caches(dtype)
    host = torch.zeros((5, len(caches), *caches[0].shape[1:]), dtype=dtype)
    ids, slots = [6, 0, 3], [4, 1, 2]
    blocks_to_host(caches, host, torch.tensor(ids), torch.tensor(slots), programs)
    for block, slot in zip(ids, slots):
        for layer, cache in enumerate(caches):
            assert torch.equal(host[slot, layer].view(torch.uint8), cache[block].view(torch.uint8))
    untouched = [s for s in range(5) if s not in slots]
    assert not host[untouched].view(torch.uint8).any()


def test_refuses_what_it_cannot_serve_before_moving_anything():
    caches = _caches(torch.float32)
    host = torch.zeros((5, len(caches), *caches[0].shape[1:]))
    # Layers not at one fixed distance (separate clones may land evenly spaced by chance,
    # which the kernel could serve): uneven offsets into one buffer, deterministically.
    size = caches[0].numel()
    buffer = torch.zeros(3 * size + 64)
    separate = [buffer[o : o + size].view(caches[0].shape) for o in (0, size + 8, 2 * size + 40)]
    for layer, cache in zip(separate, caches):
        layer.copy_(cache)
    assert layer_stride(separate) is None and not usable(separate, host)
    with pytest.raises(ValueError, match="one allocation"):
        blocks_to_host(separate, host, torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="do not hold"):
        blocks_to_host(caches, host[:, :2], torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="block ids for"):
        blocks_to_host(caches, host, torch.tensor([1, 2]), torch.tensor([1]))
    assert not host.any()
