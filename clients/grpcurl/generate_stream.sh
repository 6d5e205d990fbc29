#!/usr/bin/env bash
# Usage: generate_stream.sh [ADAPTER] [TEXT]. Deltas per input index; the last one carries finish_reason.
# Behind a router (deploy/nginx) the x-loraplex-adapter header keeps ADAPTER on one replica.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
ADAPTER="${1:-}"; TEXT="${2:-List 3 countries and their capitals.}"
call "$INFERENCE" loraplex.v1.Inference/GenerateStream "$(cat <<JSON
{"text": ["$TEXT"], "adapter": ["$ADAPTER"], "sampling_params": {"max_new_tokens": 32}}
JSON
)" ${ADAPTER:+-H "x-loraplex-adapter: $ADAPTER"}
