#!/usr/bin/env bash
# Usage: generate.sh [ADAPTER] [TEXT]. A batch of two: TEXT on ADAPTER and on the base model.
# Behind a router (deploy/nginx) the x-loraplex-adapter header keeps ADAPTER on one replica.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
ADAPTER="${1:-}"; TEXT="${2:-List 3 countries and their capitals.}"
call "$INFERENCE" loraplex.v1.Inference/Generate "$(cat <<JSON
{"text": ["$TEXT", "$TEXT"], "adapter": ["$ADAPTER", ""],
 "sampling_params": {"max_new_tokens": 32, "temperature": 0}}
JSON
)" ${ADAPTER:+-H "x-loraplex-adapter: $ADAPTER"}
