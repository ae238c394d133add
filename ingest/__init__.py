"""The per-node durable journal and the Spark streaming source that replays it by offset."""
