"""The MQTT broker edge: codec, topic trie, sessions, router, listener."""
