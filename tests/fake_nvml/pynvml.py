"""A FAKE `pynvml` (nvidia-ml-py) for tests: the NVML boundary of kiln.trainer.observe.gpu_health, nothing else faked.

Put this folder first on PYTHONPATH (or this module in sys.modules["pynvml"]) and point FAKE_NVML_STATE at a
JSON file; every call reads the file again, so a test changes a GPU's health while the trainer runs:

    {"gpus": [{"name": "FAKE-H200", "temperature": 50, "slowdown": 90, "ecc_uncorrected": 0,
               "ecc_corrected": 0, "remap_pending": false, "xids": [79]}],
     "init_error": null}

`xids` are delivered once each through the event set (as NVML delivers each XID event once); `init_error`
makes nvmlInit raise (a node whose driver is gone). Only the calls kiln.trainer.observe.gpu_health makes exist here.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeXidCriticalError = 8

_delivered: dict[int, int] = {}  # GPU index → XIDs of the file already delivered


class NVMLError(Exception):
    pass


def _state() -> dict:
    path = os.environ.get("FAKE_NVML_STATE")
    if not path:
        raise NVMLError("FAKE_NVML_STATE is not set")
    with open(path) as f:
        return json.load(f)


def _gpu(handle) -> dict:
    gpus = _state().get("gpus") or []
    if handle.index >= len(gpus):
        raise NVMLError("GPU is lost")
    return gpus[handle.index]


def nvmlInit() -> None:
    err = _state().get("init_error")
    if err:
        raise NVMLError(err)


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_state().get("gpus") or [])


def nvmlDeviceGetHandleByIndex(index: int):
    return SimpleNamespace(index=index)


def nvmlDeviceGetIndex(handle) -> int:
    return handle.index


def nvmlDeviceGetName(handle) -> str:
    return _gpu(handle).get("name", "FAKE-GPU")


def nvmlDeviceGetTemperature(handle, sensor) -> int:
    return int(_gpu(handle).get("temperature", 40))


def nvmlDeviceGetTemperatureThreshold(handle, kind) -> int:
    return int(_gpu(handle).get("slowdown", 90))


def nvmlDeviceGetTotalEccErrors(handle, error_type, counter) -> int:
    key = "ecc_uncorrected" if error_type == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "ecc_corrected"
    return int(_gpu(handle).get(key, 0))


def nvmlDeviceGetRemappedRows(handle) -> tuple[int, int, int, int]:
    return 0, 0, int(bool(_gpu(handle).get("remap_pending"))), 0


def nvmlEventSetCreate():
    return SimpleNamespace(handles=[])


def nvmlDeviceRegisterEvents(handle, types, event_set) -> None:
    event_set.handles.append(handle)


def nvmlEventSetWait(event_set, timeout_ms: int):
    for handle in event_set.handles:
        xids = _gpu(handle).get("xids") or []
        done = _delivered.get(handle.index, 0)
        if done < len(xids):
            _delivered[handle.index] = done + 1
            return SimpleNamespace(device=handle, eventData=xids[done])
    raise NVMLError("Timeout")


def nvmlEventSetFree(event_set) -> None:
    pass
