"""A run-state part the trainer does not know (kiln.trainer.state), for the registry's tests: a count."""

from __future__ import annotations


class Counter:
    """State {"n": int}; a commit saved before it existed loads as 0."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict | None) -> None:
        self.n = 0 if state is None else int(state["n"])
