"""Imports test/kernel_utils.py first: without CUDA it sets TRITON_INTERPRET=1 before any test imports triton."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import kernel_utils  # noqa: E402,F401
