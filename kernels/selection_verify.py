"""Output checks for the kernel tuner: while tuning, each candidate's output is
compared with the first candidate's, so a fast but wrong kernel is never chosen."""

from __future__ import annotations

from collections.abc import Callable

import torch


def snapshot(output):
    """A copy of a candidate's output that later candidates (writing the same `out`
    buffer) cannot overwrite."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if isinstance(output, (tuple, list)):
        return type(output)(snapshot(x) for x in output)
    return output


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for x in output for t in _tensors(x)]
    return []


# How far a candidate attention kernel's output may part from the first candidate's
# (extend and MLA decode): tol * (1 + |x|) by dtype. Between two correct kernels outputs
# differ by rounding (p is rounded to the input dtype before P @ V); a wrong mask or a
# misread tile is off by far more.
ATTENTION_TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def close_outputs(
    tolerance: dict[torch.dtype, float], default: float = 1e-2, chunk: int = 1 << 22
) -> Callable[[object, object], str | None]:
    """A Selector `verify`: the output tensors must match the reference's shapes and
    dtypes, and every element y of them its reference x within tol * (1 + |x|), tol
    by dtype (NaN only where the reference has NaN). Compared in float32 chunks of
    `chunk` elements, so the check needs little memory beyond the reference copy."""

    def verify(reference, output) -> str | None:
        refs, outs = _tensors(reference), _tensors(output)
        if len(refs) != len(outs):
            return f"{len(outs)} output tensors, the reference has {len(refs)}"
        for i, (ref, out) in enumerate(zip(refs, outs)):
            if ref.shape != out.shape or ref.dtype != out.dtype:
                return (
                    f"output {i} is {out.dtype} {tuple(out.shape)}, "
                    f"the reference {ref.dtype} {tuple(ref.shape)}"
                )
            tol = tolerance.get(ref.dtype, default)
            flat_ref, flat_out = ref.reshape(-1), out.reshape(-1)
            for start in range(0, flat_ref.numel(), chunk):
                x = flat_ref[start : start + chunk].float()
                y = flat_out[start : start + chunk].float()
                diff = (x - y).abs()
                ok = (x == y) | (diff <= tol * (1 + x.abs())) | (x.isnan() & y.isnan())
                if not bool(ok.all()):
                    bad = (~ok).nonzero()[0, 0].item()
                    return (
                        f"output {i} element {start + bad}: {y[bad].item():.6g} vs "
                        f"{x[bad].item():.6g} (tolerance {tol:g} * (1 + |x|))"
                    )
        return None

    return verify
