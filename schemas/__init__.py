"""Schemas defined once: journal records (Arrow) and every Delta table (Arrow and Spark)."""
