"""The kubeflow-training models (and the kubernetes models they re-export) as kiln builds objects with them."""

from __future__ import annotations

from functools import partial

from kubeflow.training import ApiClient, Configuration
from kubeflow.training import models as _models

_CONFIG = Configuration()  # one for every model and the serializer (see _SharedConfigModels)


class _SharedConfigModels:
    """kubeflow.training.models (and the kubernetes models it re-exports), each made with one shared
    Configuration. Without one, every model makes its own, and Configuration() sets two loggers' levels, which
    clears the level cache of every logger in the process under logging's global lock: ~40 models per
    PyTorchJob cost a new run ~30 of the operator's ~43 ms of CPU in a burst, and stalled the threads that log."""

    def __getattr__(self, name: str):
        return partial(getattr(_models, name), local_vars_configuration=_CONFIG)


K8S_MODELS = _SharedConfigModels()
SERIALIZER = ApiClient(_CONFIG)  # sanitize_for_serialization only: it sends nothing
