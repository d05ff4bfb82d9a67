"""Speed-up for Triton's CPU interpreter (TRITON_INTERPRET=1), which runs our kernels in CI.

Why: the interpreter of Triton 3.6 re-patches all of `triton.language` (inspect.getmembers over
tl, tl.core, tl.math and the tensor class: ~1 ms) on *every* call of a nested @triton.jit
function, tl.sum / tl.max / tl.zeros included, although the kernel launch around it has already
patched the same module objects with the same interpreter builder, and the nested call never
undoes its patch. One int2 decode call at batch 8 makes ~1300 such calls: a third of its time.

What: `install()` wraps the interpreter's `_patch_lang` so that it patches only the language
modules a function sees that are not patched yet (tested by whether their `add` is still the
original builtin); modules already patched are left as they are, which is the state the original
code would leave too. Results are unchanged (the whole CPU suite runs with it); only the time.

It touches nothing unless TRITON_INTERPRET=1, and only on the Triton version it was written
against; on any other version it does nothing (the interpreter is just slower).

Also (any Triton version, TRITON_INTERPRET=1 only): `install()` fixes the interpreter tensor's
`__index__` where it cannot take a one-element array (`_install_index_fix`). The decode kernel's
runtime loop bounds (`for start in range(lo, hi, BLOCK_N)`, lo/hi from seq_lens) need it: Triton
3.6 defines `__index__` as `int(handle.data)`, and numpy >= 2.4 refuses int() of a 1-element
array that is not 0-d, so the interpreted decode fails with "only 0-dimensional arrays can be
converted to Python scalars" there (numpy 1.25-2.3 warn that it is deprecated: fixed there too,
same values, no warning).
"""

from __future__ import annotations

import inspect
import operator
import os
import types

SUPPORTED_PREFIX = "3.6."
_installed = False


def _index_takes_one_element_arrays(patch_lang_tensor) -> bool:
    """Whether the `__index__` that `patch_lang_tensor` gives the interpreter tensor takes a (1,)-shaped handle
    (without numpy's deprecation warning)."""
    import warnings

    import numpy as np

    class Probe:
        pass

    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    patch_lang_tensor(Probe, Scope())
    if not hasattr(Probe, "__index__"):
        return False
    probe = Probe()
    probe.handle = types.SimpleNamespace(data=np.array([3], dtype=np.int32))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            return operator.index(probe) == 3
    except (TypeError, DeprecationWarning):
        return False


def _install_index_fix(interpreter) -> bool:
    """Make the interpreter tensor's `__index__` take the one-element arrays the interpreter holds its scalars in
    (idempotent; any Triton version). Returns whether the fix is in place."""
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if hasattr(original, "__wrapped__"):
        return True  # installed before
    try:
        if _index_takes_one_element_arrays(original):
            return False  # nothing to fix on this Triton / numpy
    except Exception:  # a probe this Triton does not fit: leave the interpreter alone
        return False

    def _index(self):
        data = self.handle.data
        if data.size != 1:
            raise TypeError(f"only a scalar tensor can be an index, got shape {data.shape}")
        return int(data.reshape(-1)[0])

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # numpy >= 2.4 refuses int() of a 1-element array (earlier: deprecated); runtime loop bounds need __index__
        scope.set_attr(tensor, "__index__", _index)

    _patch_lang_tensor.__wrapped__ = original
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True


def install() -> bool:
    """Install the wrapper (idempotent). Returns whether it is active. Also installs the `__index__` fix
    (`_install_index_fix`) under TRITON_INTERPRET=1 on any Triton version."""
    global _installed
    if _installed:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    _install_index_fix(interpreter)
    if not triton.__version__.startswith(SUPPORTED_PREFIX):
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_cls is None or not hasattr(tl.core, "is_builtin"):
        return False

    def _lang_modules(fn):
        return [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]

    def _patched(member) -> bool:
        # _patch_builtin replaces every builtin (tl.add, tensor.__add__ included) with a plain lambda
        return not tl.core.is_builtin(member)

    def _patch_lang_once(fn):
        langs = _lang_modules(fn)
        if langs and all(_patched(getattr(m, "add", None)) for m in langs) and _patched(tl.tensor.__add__):
            return scope_cls()  # nothing to patch, nothing to restore
        return original(fn)

    _patch_lang_once.__wrapped__ = original
    interpreter._patch_lang = _patch_lang_once
    _installed = True
    return True
