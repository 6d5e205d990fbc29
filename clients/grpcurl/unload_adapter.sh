#!/usr/bin/env bash
# Usage: unload_adapter.sh NAME
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$INFERENCE" loraplex.v1.Inference/UnloadAdapter "{\"name\": \"$1\"}"
