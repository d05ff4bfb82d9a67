"""Triton kernels of the INT2 KV cache: write (write.py), decode (decode.py), prefix gather (gather.py)."""

from . import interpreter as _interpreter

_interpreter.install()  # no-op unless TRITON_INTERPRET=1 (CPU tests); see interpreter.py
