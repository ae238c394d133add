#!/usr/bin/env bash
# Set up .venv and run every check: ruff (lint + format), mypy strict, the whole pytest suite.
set -euo pipefail
export EDGEBUS_SETUP_FOR=tests  # the set-up the tests need too (Node.js and MQTT.js)
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
echo "== ruff" && ruff check . && ruff format --check .
echo "== mypy" && mypy
echo "== pytest"
set +e
# Two workers: much of the suite waits (sockets, subprocesses, Spark's scheduling), not computes.
pytest -n 2 --dist loadfile "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit $rc
