"""kiln.control.kopf_fix: kopf's index pre-population wakes its waiters when the set's state changes, not per object."""

from __future__ import annotations

import asyncio

from kopf._cogs.aiokits import aiotoggles

from kiln.control import kopf_fix


def _startup(objects: int) -> tuple[int, list[str]]:
    """kopf's startup pattern (reactor.queueing/processing): a blocker toggle, then per object a toggle made
    when it is seen, the object's worker dropping it and waiting until the whole set is on. Returns how many
    times the waiters' condition was checked in all, and the order in which things finished."""
    checks = 0
    order: list[str] = []

    async def main() -> None:
        nonlocal checks
        indexed = aiotoggles.ToggleSet(all)
        blocker = await indexed.make_toggle(name="listing")

        def counted():
            nonlocal checks
            checks += 1
            return indexed.is_on()

        async def worker(i: int, toggle: aiotoggles.Toggle) -> None:
            await indexed.drop_toggle(toggle)
            async with indexed._condition:  # ToggleSet.wait_for(True), with its predicate counted
                await indexed._condition.wait_for(counted)
            order.append(f"worker {i}")

        workers = []
        for i in range(objects):
            toggle = await indexed.make_toggle(name=f"object {i}")
            workers.append(asyncio.create_task(worker(i, toggle)))
            await asyncio.sleep(0)  # the worker starts, drops its toggle and waits (as the listing goes on)
        await asyncio.sleep(0)
        order.append("listed")
        await indexed.drop_toggle(blocker)  # the listing is over: every object may be handled now
        await asyncio.wait_for(asyncio.gather(*workers), timeout=60)

    asyncio.run(main())
    return checks, order


def test_every_waiting_worker_runs_once_the_listing_is_over_and_none_before():
    assert kopf_fix.apply()
    _, order = _startup(50)
    assert order[0] == "listed" and sorted(order[1:]) == sorted(f"worker {i}" for i in range(50))


def test_workers_are_woken_when_the_set_turns_on_not_once_per_object():
    assert kopf_fix.apply(), "the installed kopf is not one the fix was checked against: read its ToggleSet"
    checks, _ = _startup(400)
    # each worker checks once when it starts waiting and once when the set turns on; kopf's own methods
    # woke every waiting worker on every toggle made or dropped (~400 * 400 / 2 * 2 checks)
    assert checks <= 2 * 400 + 10


def test_a_toggle_turned_on_still_wakes_its_set():
    assert kopf_fix.apply()

    async def main() -> bool:
        indexed = aiotoggles.ToggleSet(all)
        toggle = await indexed.make_toggle(name="one")
        waiter = asyncio.create_task(indexed.wait_for(True))
        await asyncio.sleep(0)
        assert not waiter.done()
        await toggle.turn_to(True)
        await asyncio.wait_for(waiter, timeout=10)
        return indexed.is_on()

    assert asyncio.run(main())


def test_a_kopf_release_the_fix_was_not_checked_against_is_left_alone():
    assert kopf_fix._checked("1.45.2") and kopf_fix._checked("1.45.0")
    assert not kopf_fix._checked("1.46.0") and not kopf_fix._checked("2.0.0") and not kopf_fix._checked("1.44.6")


def test_a_reconcile_that_succeeds_at_once_leaves_kopf_nothing_to_patch():
    # kiln.control.kopf_settings.RetryAnnotations: kopf records the handler's progress and purges it once done; its
    # `kiln.dev/kopf-managed` marker would stay in the patch and cost every new run a PATCH of the TrainingSpec
    from kopf._cogs.structs import bodies, patches

    from kiln.control.kopf_settings import RetryAnnotations

    storage = RetryAnnotations(prefix="kiln.dev")
    body = bodies.Body({"metadata": {"name": "run", "namespace": "ml", "annotations": {}}})
    patch = patches.Patch()
    storage.store(key="reconcile", record={"started": "2026-01-01T00:00:00", "success": True, "retries": 1},
                  body=body, patch=patch)
    assert patch.metadata.annotations["kiln.dev/reconcile"]  # a retry's record is kept while it retries
    storage.purge(key="reconcile", body=body, patch=patch)
    assert not patch, dict(patch)  # kopf sends no PATCH (its own storage leaves {'kiln.dev/kopf-managed': 'yes'})
