#!/usr/bin/env bash
# Set up .venv and run every check: ruff (lint + format), mypy strict, the whole pytest suite.
set -euo pipefail
export EDGEBUS_SETUP_FOR=tests  # the set-up the tests need too (Node.js and MQTT.js)
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
echo "== ruff" && ruff check . && ruff format --check .
echo "== mypy" && mypy
echo "== pytest"
# The suite's JVMs (Spark drivers, a standalone cluster's master, workers and executors) live
# for seconds to minutes: JIT-compiling with C1 alone spends ~40 % less CPU on them than the
# default tiered C1 + C2, whose optimised code would only pay off in a long run (BENCHMARKS.md,
# "CI time: the tests' JVMs with C1 alone"). The platform's own runs and bench/ keep the default.
C1_ONLY="-XX:TieredStopAtLevel=1"
export SPARK_SUBMIT_OPTS="${SPARK_SUBMIT_OPTS:+$SPARK_SUBMIT_OPTS }$C1_ONLY"
export SPARK_DAEMON_JAVA_OPTS="${SPARK_DAEMON_JAVA_OPTS:+$SPARK_DAEMON_JAVA_OPTS }$C1_ONLY"
# The suite's Spark settings (scripts/test-spark-conf) as a properties file, not as
# SPARK_CONF_DIR: Spark's launcher puts that folder first on the driver's class path, and the
# JVM's class archive (streaming.class_archive) fits only the class path it was made with.
export PYSPARK_SUBMIT_ARGS="${PYSPARK_SUBMIT_ARGS:---properties-file '$ROOT/scripts/test-spark-conf/spark-defaults.conf' pyspark-shell}"
set +e
# Three workers on two cores: much of the suite waits (sockets, subprocesses, timeouts, Spark's
# scheduling), not computes; a third worker fills those waits (pytest 15 min 24 s against
# 19 min 20 s with two on the same host, BENCHMARKS.md "CI with three workers").
pytest -n 3 --dist loadfile "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit $rc
