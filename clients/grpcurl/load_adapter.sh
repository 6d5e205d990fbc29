#!/usr/bin/env bash
# Usage: load_adapter.sh NAME SOURCE [pin]. SOURCE: a directory the store (or server) can read, or hf://org/repo.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
NAME="$1"; SRC="$2"; PIN="${3:+true}"
call "$INFERENCE" loraplex.v1.Inference/LoadAdapter "{\"name\": \"$NAME\", \"source\": \"$SRC\", \"pin\": ${PIN:-false}}"
