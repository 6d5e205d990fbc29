#!/usr/bin/env bash
# Usage: detokenize.sh [ID...]. The text of these token ids on the server (special tokens kept).
set -euo pipefail; source "$(dirname "$0")/_common.sh"
ids=$(IFS=,; echo "${*:-19556,28}")
call "$INFERENCE" loraplex.v1.Inference/Detokenize "{\"token_ids\": [$ids]}"
