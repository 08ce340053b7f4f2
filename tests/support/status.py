"""Stand-ins for the trainer's status reporting: a record as the loop logs it, a sender that keeps what it would
patch, and a clock the test moves (shared by the status-report and tracking tests)."""

from __future__ import annotations


def record(step: int, step_s: float = 1.0, **extra) -> dict:
    return {"step": step, "loss": 2.0, "step_s": step_s, "tokens_per_second": 4096.0 / step_s, "mfu": 0.41, **extra}


class FakeSender:
    """Records what would be patched (the real StatusSender is exercised against the rig and a closed port)."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.closed = False

    def submit(self, body: dict) -> None:
        self.bodies.append(body)

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t
