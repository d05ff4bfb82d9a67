#!/usr/bin/env bash
# GLM-4.7-FP8: defaults shared by this directory's scripts (sourced). Every value can be overridden
# from the environment. FP8 MoE, 92 layers; TP 8; sampling T 1.0 (model card).
export MODEL_NAME=GLM-4.7-FP8
export MODEL=${MODEL:-zai-org/GLM-4.7-FP8}
export TP_SIZE=${TP_SIZE:-8}
export REASONING_PARSER=${REASONING_PARSER:-glm45}
export TEMPERATURE=${TEMPERATURE:-1.0}
export TOP_K=${TOP_K:-40}
# V absorption folds T_V into bf16 Llama/Qwen2/Qwen3 attention weights only; this FP8 GLM MoE gets V
# rotated at runtime (slower decode) instead of a refused start.
export ABSORB_V=${ABSORB_V:-0}
export EXPECT_LAYERS=92  # checked by `python -m sglang_oscar.zoo verify --model-config` against config.json
