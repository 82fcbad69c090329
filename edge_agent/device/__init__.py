"""Device: facts about the host.

CPU, memory, disk, GPUs through NVML, a Jetson's sysfs, energy counters and the capabilities the
controller chooses a model variant by (:mod:`.health`, :mod:`.jetson`). May import ``inference`` (to
name the execution providers this host can run), ``uplink``, ``core`` and ``fleet_protocol``.
"""
