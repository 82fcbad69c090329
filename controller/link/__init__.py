"""The device link: MQTT bridge, broker accounts, ingest, presence, commands, artifact server."""
