"""sglang-oscar: OSCAR attention-aware rotations + INT2 KV cache for SGLang.

Layout (each layer has a pure-PyTorch oracle in ``quant/``):
  config     one frozen description of the cache format and its byte math
  quant/     reference math: Hadamard, spectral placement, clip, INT2/INT4, packing
  rotation/  offline calibration: capture Q/K/V, covariances, R = U·H·P, clip ratios, bundles
  kernels/   Triton write / decode kernels, each tested against quant/
  srt/       SGLang glue only
  eval/      accuracy harness (simulator, perplexity, NIAH, attention KL)
"""

__version__ = "0.1.0"
