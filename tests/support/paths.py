"""Where the repository, its bundled models and its test footage are."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
FOOTAGE = MODELS / "footage" / "vtest.avi"
