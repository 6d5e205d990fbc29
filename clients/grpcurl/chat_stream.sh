#!/usr/bin/env bash
# Usage: chat_stream.sh [ADAPTER] [QUESTION]. A chat rendered by the server's chat template (the
# adapter's own when it ships one), streamed; the last message carries the timing fields.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
ADAPTER="${1:-}"; QUESTION="${2:-List 3 countries and their capitals.}"
call "$INFERENCE" loraplex.v1.Inference/GenerateStream "$(cat <<JSON
{"inputs": [{"messages": [{"role": "user", "content": "$QUESTION"}], "adapter": "$ADAPTER"}],
 "sampling_params": {"max_new_tokens": 32}}
JSON
)"
