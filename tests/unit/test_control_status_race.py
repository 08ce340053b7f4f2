"""The status is derived from the watch's view as it is when the run's lock is held, not as it was when a
handler started: a handler that read the pods, then waited for the lock while another wrote the status from a
newer view, moved a replica group back from Running and counted a restart that never happened (seen on a
loaded CI machine in tests/integration/test_operator_groups.py)."""

from __future__ import annotations

import threading

from kiln.control import sync
from kiln.control.runs import Runs

KEY = ("ns", "run")


class _Kube:
    """What refresh_status touches before it derives: the run's lock and the TrainingSpec it last wrote."""

    def __init__(self) -> None:
        self.runs = Runs()

    def last_spec(self, namespace: str, name: str) -> dict:
        return {"metadata": {"namespace": namespace, "name": name, "uid": "u"}, "spec": {}}


def test_refresh_status_reads_the_watch_under_the_runs_lock_and_derives_from_that(monkeypatch):
    kube, derived, reads = _Kube(), [], []
    monkeypatch.setattr(sync, "_write_status", lambda kube, body, post, accepted, job, pods, *a, **kw:
                        derived.append((job, pods)))
    view = {"pods": [{"metadata": {"name": "run-g1-worker-0"}, "status": {"phase": "Pending"}}]}

    def pods():
        reads.append(kube.runs[KEY].lock.locked())
        return view["pods"]

    lock = kube.runs[KEY].lock
    lock.acquire()  # another handler is writing the status
    worker = threading.Thread(target=sync.refresh_status, args=(kube, *KEY, None),
                              kwargs={"job": lambda: [], "pods": pods})
    worker.start()
    # the watch moves on while this handler waits for the lock: the pod is Running now
    view["pods"] = [{"metadata": {"name": "run-g1-worker-0"}, "status": {"phase": "Running"}}]
    lock.release()
    worker.join()
    assert reads == [True]
    [(job, seen)] = derived
    assert seen[0]["status"]["phase"] == "Running"  # the newer view, not the one of when the handler began


def test_a_plain_value_is_still_taken_as_it_is():
    assert sync.observed_now([1]) == [1] and sync.observed_now(None) is None and sync.observed_now(sync.READ) is sync.READ
