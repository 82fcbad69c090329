"""Update: the agent replacing itself, A/B, with a supervisor that rolls a bad version back.

:mod:`.self_update` is the agent's half (fetch, verify, install into a slot, hand over);
:mod:`.supervisor` is the base install's process that starts a slot and judges it, and reaches only
the slot state and the settings (tests/unit/test_architecture.py holds it to that); :mod:`.package`
builds an agent package. May import ``device``, ``inference``, ``uplink``, ``core`` and
``fleet_protocol``.
"""
