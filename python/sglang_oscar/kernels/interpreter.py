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
"""

from __future__ import annotations

import inspect
import os

SUPPORTED_PREFIX = "3.6."
_installed = False


def install() -> bool:
    """Install the wrapper (idempotent). Returns whether it is active."""
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
