#!/usr/bin/env bash
# Usage: store_register_adapter.sh NAME SOURCE [REVISION]. Registers in the store only.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$STORE" loraplex.v1.AdapterStore/RegisterAdapter "{\"name\": \"$1\", \"source\": \"$2\", \"revision\": \"${3:-}\"}"
