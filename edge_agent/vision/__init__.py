"""Vision: frames to detections.

Capture threads keep each camera's newest frame (:mod:`.capture`; an RTSP camera's transport and why
its stream did not open: :mod:`.rtsp`); the pipeline batches them across
cameras, runs the loaded model and decodes (:mod:`.pipeline`); a watchdog replaces a hung inference
thread (:mod:`.inference_watchdog`). May import ``device``, ``inference``, ``uplink``, ``core`` and
``fleet_protocol`` (whose ``vision`` package holds the preprocessing and decoders the controller's
fidelity check runs too); ``cv2`` is imported here and in ``control.commands`` (snapshots), nowhere
else in the agent.
"""
