"""kiln's API: the TrainingSpec models (pydantic v2). Imports no torch and no other kiln package."""

from kiln.api.presets import PRESETS, ModelDims, resolve_model
from kiln.api.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, TrainingSpec, TrainingSpecSpec

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "PRESETS", "ModelDims", "TrainingSpec",
           "TrainingSpecSpec", "resolve_model"]
