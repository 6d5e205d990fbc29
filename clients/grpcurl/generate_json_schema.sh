#!/usr/bin/env bash
# Usage: generate_json_schema.sh [ADAPTER]. Constrained decoding in one batch: a chat on ADAPTER whose
# answer is JSON valid under a schema (sampling_params.json_schema, the schema as JSON text), beside a
# free-text input on the base model and a choice between two strings.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
ADAPTER="${1:-}"
SCHEMA='{\"type\": \"object\", \"properties\": {\"country\": {\"type\": \"string\", \"maxLength\": 20}, \"capital\": {\"type\": \"string\", \"maxLength\": 20}}, \"required\": [\"country\", \"capital\"], \"additionalProperties\": false}'
call "$INFERENCE" loraplex.v1.Inference/Generate "$(cat <<JSON
{"inputs": [
  {"messages": [{"role": "user", "content": "Name a European country and its capital, as JSON."}],
   "adapter": "$ADAPTER", "sampling_params": {"max_new_tokens": 64, "json_schema": "$SCHEMA"}},
  {"text": "The capital of France is"},
  {"text": "Is Paris in France? Answer yes or no.",
   "sampling_params": {"max_new_tokens": 4, "choice": {"choices": ["yes", "no"]}}}],
 "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
JSON
)"
