"""A fix to kopf's startup with indexes, applied when kiln.control.handlers is imported.

kopf runs no handler until every index is filled: each object gets a toggle in one ToggleSet when first
seen and drops it once indexed, and each object's worker waits until the whole set is on. kopf 1.45's
ToggleSet.make_toggle/drop_toggle(s) notify every waiter on every call, so listing N pods wakes up to N
waiting workers 2N times: O(N^2) at startup (with 5,000 pods on the rig the operator ran no handler in
the 22 minutes before the measurement gave up; an attempt at 20,000 never got past it). A ToggleSet's
waiters wait for its overall state (`ToggleSet.wait_for`) and a Toggle's for its own (`Toggle.wait_for`), and neither changes when a member is
added or dropped without changing the set's state: waking them on a change of that state is enough.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from importlib.metadata import version

from kopf._cogs.aiokits import aiotoggles

# The kopf releases whose private ToggleSet (`_toggles`, `_condition`, notify on every change) this was read
# against; another release is left as it is, with a warning, and test_control_kopf_fix fails until checked.
CHECKED = ((1, 45), (1, 45))


async def _make_toggle(self: aiotoggles.ToggleSet, __val: bool = False, *, name: str | None = None) -> aiotoggles.Toggle:
    toggle = aiotoggles.Toggle(__val, name=name, condition=self._condition)
    async with self._condition:
        before = self.is_on()
        self._toggles.add(toggle)
        if self.is_on() != before:
            self._condition.notify_all()
    return toggle


async def _drop_toggles(self: aiotoggles.ToggleSet, toggles: Iterable[aiotoggles.Toggle]) -> None:
    async with self._condition:
        before = self.is_on()
        self._toggles.difference_update(toggles)
        if self.is_on() != before:
            self._condition.notify_all()


async def _drop_toggle(self: aiotoggles.ToggleSet, toggle: aiotoggles.Toggle) -> None:
    await _drop_toggles(self, (toggle,))


def _checked(release: str) -> bool:
    major_minor = tuple(int(part) for part in release.split(".")[:2])
    return CHECKED[0] <= major_minor <= CHECKED[1]


def apply() -> bool:
    """Replace the three ToggleSet methods (idempotent); False, and kopf unchanged, on an unchecked release."""
    release = version("kopf")
    if not _checked(release):
        logging.getLogger(__name__).warning(
            "kopf %s is not a release kiln's startup fix was checked against (%d.%d-%d.%d): kopf's own index "
            "startup is kept, which is quadratic in the number of pods", release, *CHECKED[0], *CHECKED[1])
        return False
    aiotoggles.ToggleSet.make_toggle = _make_toggle
    aiotoggles.ToggleSet.drop_toggle = _drop_toggle
    aiotoggles.ToggleSet.drop_toggles = _drop_toggles
    return True
