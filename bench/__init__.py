"""Benchmark tools for edgebus: a broker-agnostic MQTT 3.1.1 load generator and comparisons.

Nothing here imports the edgebus packages, so the same generator measures any broker fairly.

- `bench.wire` — sans-IO MQTT 3.1.1 encoding/decoding (only what a load generator needs).
- `bench.loadgen` — publisher/subscriber worker processes and the scenarios (CLI).
- `bench.sink` — the "null" broker used to measure the generator's own ceiling.
- `bench.brokers` — start/stop Mosquitto, edgebus and the null sink on a free port.
- `bench.compare` — run one scenario against several brokers in one invocation (CLI).
- `bench.suite` — the issue-3 matrix (every scenario x mosquitto, edgebus, null) (CLI).
"""


class BenchError(Exception):
    """Root of the errors raised by the bench tools."""
