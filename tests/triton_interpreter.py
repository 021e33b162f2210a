"""Triton 3.6 interpreter fixes for the CPU test runs (never used on a GPU)."""

from __future__ import annotations

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def fix_interpreter() -> None:
    """Two Triton 3.6 interpreter bugs, patched for this process only.

    numpy >= 2.4 refuses int() of a 1-element array, which the interpreter uses for
    run-time loop bounds (triton-lang/triton#9171); and its tl.dot multiplies bfloat16
    bit patterns as uint16. Neither affects compiled kernels.
    """
    if getattr(interpreter, "_yinian_fixed", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def as_float32(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        bits = x.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_dot(self, a, b, *args):
        return create_dot(self, as_float32(a), as_float32(b), *args)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter._yinian_fixed = True
