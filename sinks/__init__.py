"""Where batches go: the idempotent Delta writer, the quarantine writer, the MQTT publisher."""
