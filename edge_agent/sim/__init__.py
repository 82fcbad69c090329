"""The fleet simulator: thousands of simulated devices speaking the wire contract to a real controller.

A second client of the contract, not part of the agent: it imports ``fleet_protocol``, the agent's
version and third-party libraries only, and nothing of the agent's daemon imports it
(tests/unit/test_architecture.py holds both). It lives in this package so that ``edgefleet simulate``
ships with the agent's CLI. One concept a module, each importing only those listed before it:

- ``outbox``: a device's outbox (one seq space, resends until acked) and the seqs kept on disk
- ``device``: ``SimDevice``, what one device says and how it takes a desired state; no sockets
- ``config``: ``SimConfig``, the settings of one run, and ``SimulatorError``
- ``report``: the figures of a run, as a table and as JSON
- ``loop``: ``FleetSimulator``, every device's MQTT client on one selector loop
- ``enroll``: the devices' broker passwords, from a file or by enrolling them at a controller
- ``cli``: ``edgefleet simulate``, its options declared once, and the run they start
"""
