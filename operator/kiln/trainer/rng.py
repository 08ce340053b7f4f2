"""The random number generators' state, as JSON-safe text: saved with every commit (trainer state "rng"), sent to
a healing peer, and set back on resume, so a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import base64
import io

import torch


def _encode(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _decode(s: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(s)), weights_only=True)  # tensors only: never runs code


def rng_state(device: torch.device) -> dict:
    state = {"cpu": _encode(torch.get_rng_state())}
    if device.type == "cuda":
        state["cuda"] = _encode(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_decode(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_decode(state["cuda"]), device)
