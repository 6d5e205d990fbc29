#!/usr/bin/env bash
# Every adapter the store knows.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$STORE" loraplex.v1.AdapterStore/ListAdapters "{}"
