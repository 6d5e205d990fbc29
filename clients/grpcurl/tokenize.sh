#!/usr/bin/env bash
# Usage: tokenize.sh [TEXT]. What tokenizer(text).input_ids gives on the server.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$INFERENCE" loraplex.v1.Inference/Tokenize "{\"text\": \"${1:-Hello, world}\"}"
