#!/usr/bin/env bash
# Qwen3-4B-Thinking-2507: defaults shared by this directory's scripts (sourced). Every value can be overridden
# from the environment. Dense GQA, 36 layers, 8 KV heads, head_dim 128, 256K context.
export MODEL_NAME=Qwen3-4B-Thinking-2507
export MODEL=${MODEL:-Qwen/Qwen3-4B-Thinking-2507}
export TP_SIZE=${TP_SIZE:-1}
export REASONING_PARSER=${REASONING_PARSER:-qwen3}
export TEMPERATURE=${TEMPERATURE:-0.6}
export TOP_K=${TOP_K:-20}
export EXPECT_LAYERS=36  # checked by `python -m sglang_oscar.zoo verify --model-config` against config.json
