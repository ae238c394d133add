#!/usr/bin/env bash
# Set up .venv and run the platform on its embedded default: one edge on 127.0.0.1:1883 plus the
# Spark pipeline writing Delta tables under ./lake. Extra arguments go to `edgebus run`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec edgebus run "$@"
