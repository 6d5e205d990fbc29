#!/usr/bin/env bash
# Usage: store_delete_adapter.sh NAME. Inference servers drop it once its running requests finish.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$STORE" loraplex.v1.AdapterStore/DeleteAdapter "{\"name\": \"$1\"}"
