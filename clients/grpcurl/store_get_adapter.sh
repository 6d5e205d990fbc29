#!/usr/bin/env bash
# Usage: store_get_adapter.sh NAME
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$STORE" loraplex.v1.AdapterStore/GetAdapter "{\"name\": \"$1\"}"
