# Sourced by the examples: which grpcurl, which servers. Override with env vars.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
if [ -z "${GRPCURL:-}" ]; then
  if [ -x "$REPO/.venv/bin/grpcurl" ]; then GRPCURL="$REPO/.venv/bin/grpcurl"; else GRPCURL=grpcurl; fi
fi
INFERENCE="${INFERENCE:-127.0.0.1:50051}"
STORE="${STORE:-127.0.0.1:50052}"
# Reflection gives grpcurl the schema: no .proto files needed.
# Extra grpcurl flags after the body, e.g. the routing header a router (deploy/nginx) hashes.
call() { local target="$1" method="$2" body="$3"; shift 3; "$GRPCURL" -plaintext "$@" -d "$body" "$target" "$method"; }
