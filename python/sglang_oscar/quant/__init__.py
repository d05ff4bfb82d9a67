"""Reference math (the oracle): every kernel in ``kernels/`` is tested against these functions."""

from .clip import clip_count, clip_rows, clip_threshold
from .hadamard import block_hadamard_matrix, fwht, hadamard_matrix
from .intq import PARAM_DTYPE, QuantizedRows, round_param, dequantize, fake_quantize, levels, quantize
from .kv import SideQuantizer, apply_transform
from .pack import pack, pack_int2, pack_int4, pack_int4_planes, unpack, unpack_int2, unpack_int4, unpack_int4_planes
from .placement import bit_reversal, group_shares, permutation_matrix, spectral_placement

__all__ = [
    "PARAM_DTYPE",
    "QuantizedRows",
    "SideQuantizer",
    "apply_transform",
    "bit_reversal",
    "block_hadamard_matrix",
    "clip_count",
    "clip_rows",
    "clip_threshold",
    "dequantize",
    "fake_quantize",
    "fwht",
    "group_shares",
    "hadamard_matrix",
    "levels",
    "pack",
    "pack_int2",
    "pack_int4",
    "pack_int4_planes",
    "permutation_matrix",
    "quantize",
    "round_param",
    "spectral_placement",
    "unpack",
    "unpack_int2",
    "unpack_int4",
    "unpack_int4_planes",
]
