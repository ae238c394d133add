#!/usr/bin/env bash
# Create or update ./.venv from the project's own files. Sourced by scripts/run.sh and scripts/test.sh.
# Fails with a clear message when a system part is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

die() { echo "edgebus setup: $*" >&2; exit 1; }

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
[[ -n "$PY" ]] || die "Python 3.11 is required (no python3.11 or python3 on PATH)."
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' \
  || die "Python 3.11 is required; $PY is $("$PY" -c 'import sys; print(sys.version.split()[0])')."

JAVA="${EDGEBUS_JAVA:-java}"  # EDGEBUS_JAVA: another java binary (the tests use it too)
command -v "$JAVA" >/dev/null 2>&1 \
  || die "Java 17+ is required for Spark: no '$JAVA' on PATH (Debian: apt-get install openjdk-17-jre-headless)."
JAVA_MAJOR="$("$JAVA" -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)"
[[ -n "$JAVA_MAJOR" && "$JAVA_MAJOR" -ge 17 ]] \
  || die "Java 17+ is required for Spark; found: $("$JAVA" -version 2>&1 | head -n1)."

# Node.js, npm and MQTT.js (tests/js): only the tests need them (scripts/test.sh sets
# EDGEBUS_SETUP_FOR=tests); running the platform does not.
if [[ "${EDGEBUS_SETUP_FOR:-}" == tests ]]; then
  # Node.js and npm: the tests run MQTT.js, a stock JavaScript client (tests/js).
  NODE="${EDGEBUS_NODE:-node}"  # EDGEBUS_NODE: another node binary (the tests use it too)
  command -v "$NODE" >/dev/null 2>&1 \
    || die "Node.js 18+ and npm are required for the MQTT.js tests: no '$NODE' on PATH (Debian: apt-get install nodejs npm)."
  NODE_MAJOR="$("$NODE" --version 2>/dev/null | sed -n 's/^v\([0-9]*\)\..*/\1/p')"
  [[ -n "$NODE_MAJOR" && "$NODE_MAJOR" -ge 18 ]] \
    || die "Node.js 18+ is required for the MQTT.js tests; found: $("$NODE" --version 2>&1 | head -n1)."
  command -v npm >/dev/null 2>&1 \
    || die "npm is required to install MQTT.js for the tests: no 'npm' on PATH (Debian: apt-get install npm)."
fi

if [[ ! -x .venv/bin/python ]]; then
  echo "edgebus setup: creating .venv with $PY" >&2
  "$PY" -m venv .venv || die "could not create .venv (Debian: apt-get install python3-venv)."
fi

# Reinstall only when the project's dependency files changed.
STAMP=".venv/.edgebus-install-stamp"
WANT="$(cat pyproject.toml scripts/bootstrap.sh scripts/delta-jars.sh | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
  echo "edgebus setup: installing edgebus and its dependencies into .venv" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
  .venv/bin/python -m pip install --quiet -e ".[dev]" || die "pip install failed (see above)."
  echo "$WANT" > "$STAMP"
fi
# Bytecode for the project's own modules, every time (quick when nothing changed): pip compiles
# what it installs, but not an editable install's sources, and where PYTHONDONTWRITEBYTECODE is
# set every `edgebus` command would compile them again (~80 ms of each `edgebus logs`).
.venv/bin/python -m compileall -q -j 0 broker_edge ingest streaming sinks schemas edgebus >/dev/null \
  || die "compiling the project's modules failed (python -m compileall above)."
# Bytecode in Spark's Python archives (streaming.spark_zips): every Python process Spark starts
# imports pyspark from its pyspark.zip, which holds sources only, and compiled it afresh each
# time (1.7 s against 0.5 s a process here). Quick when the archives are compiled already.
.venv/bin/python -m streaming.spark_zips \
  || die "adding bytecode to Spark's Python archives failed (python -m streaming.spark_zips above)."
if [[ "${EDGEBUS_SETUP_FOR:-}" == tests ]]; then
  # The stock JavaScript client the tests use (MQTT.js, tests/js): npm ci when its lock changed.
  JS_STAMP="tests/js/node_modules/.edgebus-install-stamp"
  JS_WANT="$(sha256sum tests/js/package-lock.json | cut -d' ' -f1)"
  if [[ ! -f "$JS_STAMP" || "$(cat "$JS_STAMP")" != "$JS_WANT" ]]; then
    echo "edgebus setup: installing MQTT.js into tests/js/node_modules (npm ci)" >&2
    (cd tests/js && npm ci --no-audit --no-fund --loglevel=error >&2) || die "npm ci in tests/js failed (see above)."
    echo "$JS_WANT" > "$JS_STAMP"
  fi
fi
# Delta Lake's jars, once (every table is written and read by Spark's own Delta).
source "$ROOT/scripts/delta-jars.sh"
# edgebus's own JVM classes (sinks/jvm), built against those jars.
source "$ROOT/scripts/edgebus-jar.sh"
# The JVM's class archive (streaming.class_archive): Spark's and Delta's classes parsed and
# verified once, then mapped by every Spark driver (2-4 s less per start). About a minute, once
# per JDK and set of jars. Without it Spark only starts slower: a failure is reported, not fatal.
if ! .venv/bin/python -m edgebus.spark_setup --check; then
  echo "edgebus setup: making the JVM's class archive for Spark (once per JDK and jars, about a minute)" >&2
  .venv/bin/python -m edgebus.spark_setup >.venv/spark-setup.log 2>&1 \
    || echo "edgebus setup: warning: no class archive, Spark starts without one: see .venv/spark-setup.log" >&2
fi
export PATH="$ROOT/.venv/bin:$PATH"
export PYSPARK_PYTHON="$ROOT/.venv/bin/python"
export PYSPARK_DRIVER_PYTHON="$ROOT/.venv/bin/python"
