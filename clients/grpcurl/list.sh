#!/usr/bin/env bash
# Lists the services of both servers through reflection.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
"$GRPCURL" -plaintext "$INFERENCE" list
"$GRPCURL" -plaintext "$STORE" list
