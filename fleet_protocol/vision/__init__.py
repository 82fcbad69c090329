"""What a model's input and output mean: preprocessing, decoders and NMS, written once.

A manifest's ``InputSpec`` and ``DecoderKind`` are part of the contract; this package is their
executable half. The agent runs it on every frame and the controller's fidelity check runs the same
code when it scores a variant against FP32, so the figure it reports measures what devices run.
Unlike the rest of ``fleet_protocol`` it needs numpy, and ``cv2`` for resizing; nothing else in
``fleet_protocol`` imports it, so the contract itself stays importable without them.
"""
