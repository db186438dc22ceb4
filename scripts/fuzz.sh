#!/usr/bin/env bash
# A deep run of reliability check 17: schemathesis against the real daemon (its socket, and its TCP
# listener with a key), from the daemon's own OpenAPI document, with EXAMPLES cases per operation and
# generation mode (valid, invalid) instead of `make test`'s 12. Usage: scripts/fuzz.sh [EXAMPLES [PYTEST ARGS...]]
# (e.g. -k "chat" for the operations whose path holds "chat").
set -euo pipefail
cd "$(dirname "$0")/.."
EXAMPLES="${1:-300}"
shift || true
PY="${PYTHON:-.venv/bin/python}"
echo "fuzz: ${EXAMPLES} examples per operation and mode"
MINIBATCH_FUZZ_EXAMPLES="$EXAMPLES" exec "$PY" -m pytest -q -p no:cacheprovider tests/reliability/test_fuzz.py "$@"
