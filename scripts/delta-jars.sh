#!/usr/bin/env bash
# Fetch Delta Lake's JVM half and Hadoop's S3A once, into .venv/delta-jars/, for the delta-spark
# and pyspark the venv has. Sourced by scripts/bootstrap.sh after the pip install; Spark then
# starts with these files (spark.jars, streaming/session.py) and never resolves anything again.
#
# The coordinates come from streaming.session.jar_coordinates(): the one
# delta.pip_utils.configure_spark_with_delta_pip computes
# (io.delta:delta-spark_{spark major.minor}_2.13:{delta-spark version}), and for a lake in a
# bucket org.apache.hadoop:hadoop-aws at the Hadoop version pyspark ships, with only the AWS SDK
# v2 modules S3A uses (s3, s3-transfer-manager, sts: some 18 MB) instead of the SDK's `bundle`
# (some 600 MB) that hadoop-aws declares. Maven resolves them and their runtime dependencies
# into a repository inside the venv; the jars pyspark already ships (scala, hadoop, parquet,
# jackson, netty ...) are left out, so Spark's own versions stay the only ones. The marker
# .coordinate holds the coordinates (one a line): the same ones again fetch nothing.
set -euo pipefail

delta_die() {
  echo "edgebus setup: $*" >&2
  echo "edgebus setup: to provide the jars by hand, put $(echo $COORD) and their runtime" \
    "dependencies into $DEST/ and write those coordinates, one a line, into $DEST/.coordinate" >&2
  exit 1
}

COORD="$(.venv/bin/python -c 'from streaming.session import jar_coordinates as c; print("\n".join(c()))')" \
  || { echo "edgebus setup: cannot tell which jars to fetch (see above)" >&2; exit 1; }
DEST="$ROOT/.venv/delta-jars"
if [[ -f "$DEST/.coordinate" && "$(cat "$DEST/.coordinate")" == "$COORD" ]]; then
  return 0 2>/dev/null || exit 0
fi
command -v mvn >/dev/null 2>&1 \
  || delta_die "Maven (mvn) is needed once to fetch the jars of Delta Lake and S3A ($(echo $COORD)) (Debian: apt-get install maven)."

echo "edgebus setup: fetching $(echo $COORD) and their dependencies into .venv/delta-jars" >&2
DEPENDENCIES=""
while IFS=: read -r GROUP ARTIFACT VERSION; do
  EXCLUDE=""
  # hadoop-aws declares the AWS SDK's whole bundle; the modules S3A uses are listed instead.
  [[ "$ARTIFACT" == hadoop-aws ]] \
    && EXCLUDE="<exclusions><exclusion><groupId>software.amazon.awssdk</groupId><artifactId>bundle</artifactId></exclusion></exclusions>"
  DEPENDENCIES+="<dependency><groupId>$GROUP</groupId><artifactId>$ARTIFACT</artifactId><version>$VERSION</version>$EXCLUDE</dependency>"
done <<<"$COORD"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cat >"$WORK/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>edgebus</groupId><artifactId>delta-jars</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>$DEPENDENCIES</dependencies>
</project>
POM
if ! mvn -q -B -f "$WORK/pom.xml" -Dmaven.repo.local="$ROOT/.venv/m2" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$WORK/jars" \
    >"$WORK/mvn.log" 2>&1; then
  delta_die "Maven could not fetch $(echo $COORD): $(grep -m1 -o 'Could not .*' "$WORK/mvn.log" || tail -n1 "$WORK/mvn.log")"
fi
SPARK_JARS="$(.venv/bin/python -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "jars"))')"
rm -rf "$DEST" && mkdir -p "$DEST"
for jar in "$WORK"/jars/*.jar; do
  name="$(basename "$jar" .jar)"
  artifact="${name%-*}"  # strip the version
  compgen -G "$SPARK_JARS/$artifact-[0-9]*.jar" >/dev/null || cp "$jar" "$DEST/"
done
echo "$COORD" >"$DEST/.coordinate"
