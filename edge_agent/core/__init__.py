"""Core: what every wing leans on and that leans on nothing of the agent.

Validated settings (:mod:`.settings`), bounded hand-offs with named drop policies (:mod:`.queues`),
the restart policy (:mod:`.restart_policy`: backoff, crash-loop limits), the disk guard that refuses
writes on a full disk (:mod:`.disk_guard`), atomic file writes (:mod:`.files`) and the token bucket
that bounds a camera's events (:mod:`.rate`). May import
``fleet_protocol`` and the standard library.
"""
