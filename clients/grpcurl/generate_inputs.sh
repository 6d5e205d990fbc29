#!/usr/bin/env bash
# Usage: generate_inputs.sh [ADAPTER]. One batch, three prompt forms, each with its own settings:
# text on ADAPTER (greedy), token ids ("The capital of France is") on the base model (two seeded samples), and a chat rendered
# with the chat template, with the sampled tokens' log probabilities and 2 alternatives each.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
ADAPTER="${1:-}"
call "$INFERENCE" loraplex.v1.Inference/Generate "$(cat <<JSON
{"inputs": [
  {"text": "List 3 countries and their capitals.", "adapter": "$ADAPTER"},
  {"token_ids": [504, 3575, 282, 4649, 314], "sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "seed": 7, "n": 2}},
  {"messages": [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}],
   "sampling_params": {"max_new_tokens": 8, "logprobs": true, "top_logprobs": 2}}],
 "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
JSON
)"
