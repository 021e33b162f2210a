"""Triton 3.6 interpreter fixes for the CPU test runs (never used on a GPU)."""

from __future__ import annotations

import inspect

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def fix_interpreter() -> None:
    """Two Triton 3.6 interpreter bugs, patched for this process only, and its cost.

    numpy >= 2.4 refuses int() of a 1-element array, which the interpreter uses for
    run-time loop bounds (triton-lang/triton#9171); and its tl.dot multiplies bfloat16
    bit patterns as uint16. Neither affects compiled kernels. And every kernel call
    lists every member of `triton.language` and its tensor class (`inspect.getmembers`)
    to find the builtins it wraps: about a quarter of a kernel's CPU in the suite.
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
    interpreter._patch_builtin = _patch_builtin
    interpreter._yinian_fixed = True


_BUILTINS: dict[int, list[tuple[str, object]]] = {}


def _patch_builtin(pkg, builder, scope) -> None:
    """The interpreter's own, with each package's builtins listed once: a member that
    an enclosing kernel call has already wrapped is left as it is, as before."""
    members = _BUILTINS.get(id(pkg))
    if members is None:  # first listed by an outermost call: nothing is wrapped yet
        members = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        _BUILTINS[id(pkg)] = members
    for name, member in members:
        if getattr(pkg, name, None) == member:
            interpreter._patch_attr(pkg, name, member, builder, scope)
