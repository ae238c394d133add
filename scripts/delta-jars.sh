#!/usr/bin/env bash
# Fetch Delta Lake's JVM half once, into .venv/delta-jars/, for the delta-spark the venv has.
# Sourced by scripts/bootstrap.sh after the pip install; Spark then starts with these files
# (spark.jars, streaming/session.py) and never resolves anything again.
#
# The coordinate is the one delta.pip_utils.configure_spark_with_delta_pip computes
# (io.delta:delta-spark_{spark major.minor}_2.13:{delta-spark version}). Maven resolves it and
# its runtime dependencies into a repository inside the venv; the jars pyspark already ships
# (scala, hadoop, parquet, jackson ...) are left out, so Spark's own versions stay the only ones.
set -euo pipefail

delta_die() {
  echo "edgebus setup: $*" >&2
  echo "edgebus setup: to provide the jars by hand, put $COORD and its runtime dependencies" \
    "into $DEST/ and write '$COORD' into $DEST/.coordinate" >&2
  exit 1
}

COORD="$(.venv/bin/python - <<'PY'
import importlib.metadata as m
import pyspark
spark = ".".join(pyspark.__version__.split(".")[:2])
print(f"io.delta:delta-spark_{spark}_2.13:{m.version('delta-spark')}")
PY
)"
DEST="$ROOT/.venv/delta-jars"
if [[ -f "$DEST/.coordinate" && "$(cat "$DEST/.coordinate")" == "$COORD" ]]; then
  return 0 2>/dev/null || exit 0
fi
command -v mvn >/dev/null 2>&1 \
  || delta_die "Maven (mvn) is needed once to fetch Delta Lake's jars ($COORD) (Debian: apt-get install maven)."

echo "edgebus setup: fetching $COORD and its dependencies into .venv/delta-jars" >&2
IFS=: read -r GROUP ARTIFACT VERSION <<<"$COORD"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cat >"$WORK/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>edgebus</groupId><artifactId>delta-jars</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>$GROUP</groupId><artifactId>$ARTIFACT</artifactId><version>$VERSION</version></dependency>
  </dependencies>
</project>
POM
if ! mvn -q -B -f "$WORK/pom.xml" -Dmaven.repo.local="$ROOT/.venv/m2" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$WORK/jars" \
    >"$WORK/mvn.log" 2>&1; then
  delta_die "Maven could not fetch $COORD: $(grep -m1 -o 'Could not .*' "$WORK/mvn.log" || tail -n1 "$WORK/mvn.log")"
fi
SPARK_JARS="$(.venv/bin/python -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')"
rm -rf "$DEST" && mkdir -p "$DEST"
for jar in "$WORK"/jars/*.jar; do
  name="$(basename "$jar" .jar)"
  artifact="${name%-*}"  # strip the version
  compgen -G "$SPARK_JARS/$artifact-[0-9]*.jar" >/dev/null || cp "$jar" "$DEST/"
done
echo "$COORD" >"$DEST/.coordinate"
