#!/usr/bin/env bash
# Adapters of the inference service: location (GPU/HOST/STORE), pinned, requests in flight.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$INFERENCE" loraplex.v1.Inference/ListAdapters "{}"
