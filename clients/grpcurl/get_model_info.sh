#!/usr/bin/env bash
# The base model and LoRA configuration.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$INFERENCE" loraplex.v1.Inference/GetModelInfo "{}"
