#!/usr/bin/env bash
# MiniMax-M2.7: defaults shared by this directory's scripts (sourced). Every value can be overridden
# from the environment. FP8 MoE; sampling per the model card (T 1.0, top-k 40); calibration needs the model on GPUs (DEVICE, EXTRA_CALIB_ARGS).
export MODEL_NAME=MiniMax-M2.7
export MODEL=${MODEL:-MiniMaxAI/MiniMax-M2.7}
export TP_SIZE=${TP_SIZE:-8}
export REASONING_PARSER=${REASONING_PARSER:-minimax-append-think}
export TEMPERATURE=${TEMPERATURE:-1.0}
export TOP_K=${TOP_K:-40}
# V absorption folds T_V into bf16 Llama/Qwen2/Qwen3 attention weights only; this FP8 MiniMax MoE gets V
# rotated at runtime (slower decode) instead of a refused start.
export ABSORB_V=${ABSORB_V:-0}
export EXPECT_LAYERS=62  # checked by `python -m sglang_oscar.zoo verify --model-config` against config.json
