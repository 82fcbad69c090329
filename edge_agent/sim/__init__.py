"""The fleet simulator: thousands of simulated devices speaking the wire contract to a real controller.

A second client of the contract, not part of the agent: it imports ``fleet_protocol``, paho and the
standard library only, and nothing of the agent's daemon imports it (tests/unit/test_architecture.py
holds both). It lives in this package so that ``edgefleet simulate`` ships with the agent's CLI.
"""
