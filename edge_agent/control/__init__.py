"""Control: what answers the controller.

The desired state in (:mod:`.twin`: verify, fetch, activate, report), commands and their results
(:mod:`.commands`), health out (:mod:`.heartbeat`). The highest wing below the composition root
(:mod:`edge_agent.agent`): it may import ``vision``, ``update``, ``device``, ``inference``, ``uplink``,
``core`` and ``fleet_protocol``; nothing imports it but the root.
"""
