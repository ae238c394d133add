"""Spark Structured Streaming jobs, one per Delta table: pure ``transform`` plus ``start``."""
