"""Uplink: store-and-forward to the controller.

The MQTT link (:mod:`.link`), the on-disk outbox that holds every detection and event until the
controller acknowledges it (:mod:`.outbox`), the publisher that drains it (:mod:`.publisher`), and
chunked, resumable, verified downloads of models and agent packages (:mod:`.artifacts`). May import
``core`` and ``fleet_protocol`` only, and no optional extra.
"""
