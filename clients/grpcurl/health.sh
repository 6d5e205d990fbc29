#!/usr/bin/env bash
# grpc.health.v1 of both servers: SERVING once the model is loaded and warmed up.
set -euo pipefail; source "$(dirname "$0")/_common.sh"
call "$INFERENCE" grpc.health.v1.Health/Check "{}"
call "$STORE" grpc.health.v1.Health/Check "{}"
