#!/usr/bin/env bash
# Build edgebus's own JVM classes (sinks/jvm: Delta's log store for local tables) into
# .venv/edgebus-jars/edgebus-delta.jar, against the Delta and Hadoop jars the venv has. Sourced by
# scripts/bootstrap.sh after scripts/delta-jars.sh; rebuilt only when a source or a jar it is
# built against changed (the stamp beside it).
set -euo pipefail

JAR_DIR="$ROOT/.venv/edgebus-jars"
JAR="$JAR_DIR/edgebus-delta.jar"
SPARK_JARS="$(.venv/bin/python -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')"
DELTA_JARS="${EDGEBUS_DELTA_JARS:-$ROOT/.venv/delta-jars}"
CLASSPATH="$(ls "$DELTA_JARS"/delta-storage-*.jar "$SPARK_JARS"/hadoop-client-api-*.jar \
  "$SPARK_JARS"/slf4j-api-*.jar 2>/dev/null | paste -sd: -)"
mapfile -t SOURCES < <(find "$ROOT/sinks/jvm" -name '*.java' | sort)
JAR_WANT="$(cat "${SOURCES[@]}" | sha256sum | cut -d' ' -f1) $CLASSPATH"
if [[ -f "$JAR" && -f "$JAR_DIR/.stamp" && "$(cat "$JAR_DIR/.stamp")" == "$JAR_WANT" ]]; then
  return 0 2>/dev/null || exit 0
fi
JAVAC="${EDGEBUS_JAVAC:-javac}"  # EDGEBUS_JAVAC: another javac binary
command -v "$JAVAC" >/dev/null 2>&1 \
  || { echo "edgebus setup: javac (a JDK 17+) is needed once to build edgebus's Delta log store (sinks/jvm) (Debian: apt-get install openjdk-17-jdk-headless)." >&2; exit 1; }
[[ "$CLASSPATH" == *delta-storage-* && "$CLASSPATH" == *hadoop-client-api-* ]] \
  || { echo "edgebus setup: cannot build sinks/jvm: no delta-storage jar in $DELTA_JARS or no hadoop-client-api jar in $SPARK_JARS" >&2; exit 1; }
echo "edgebus setup: building sinks/jvm into .venv/edgebus-jars/edgebus-delta.jar" >&2
JAVA_WORK="$(mktemp -d)"
"$JAVAC" --release 17 -nowarn -d "$JAVA_WORK/classes" -cp "$CLASSPATH" "${SOURCES[@]}" \
  || { rm -rf "$JAVA_WORK"; echo "edgebus setup: javac could not build sinks/jvm (see above)." >&2; exit 1; }
mkdir -p "$JAR_DIR"
# A jar is a zip of the classes (no manifest needed on a class path).
.venv/bin/python - "$JAVA_WORK/classes" "$JAR.tmp" <<'PY'
import pathlib, sys, zipfile
root = pathlib.Path(sys.argv[1])
with zipfile.ZipFile(sys.argv[2], "w") as jar:
    for path in sorted(root.rglob("*.class")):
        jar.write(path, path.relative_to(root).as_posix())
PY
mv "$JAR.tmp" "$JAR"
rm -rf "$JAVA_WORK"
echo "$JAR_WANT" >"$JAR_DIR/.stamp"
