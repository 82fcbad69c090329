"""The edgefleet controller: FastAPI API, SQLModel database, MQTT bridge and its workers.

Build one with :func:`controller.app.create_app`; nothing here runs at import time.
"""
