#!/usr/bin/env bash
# Usage: store_pull_adapter.sh NAME. Prints the header and the chunks (base64) the inference side receives.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$STORE" loraplex.v1.AdapterStore/PullAdapter "{\"name\": \"$1\"}" | head -c "${LIMIT:-2000}"; echo
