"""Observability: live detections, Prometheus metrics, energy, retention."""
