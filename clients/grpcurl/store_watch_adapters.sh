#!/usr/bin/env bash
# Follows register/delete events from the start (Ctrl-C to stop; TIMEOUT=N seconds to stop on its own).
set -euo pipefail; source "$(dirname "$0")/_common.sh"
"$GRPCURL" -plaintext ${TIMEOUT:+-max-time "$TIMEOUT"} -d "{\"last_event_id\": \"0\"}" "$STORE" loraplex.v1.AdapterStore/WatchAdapters
