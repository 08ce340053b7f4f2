"""What a PyTorchJob and its pods show: the job's state, and how many pods run. Pure; read by the status
(kiln.control.status), the replica groups' (kiln.control.replica_groups) and the elastic loop."""

from __future__ import annotations

def job_condition(job: dict | None) -> str | None:
    """The PyTorchJob's current state: the type of its newest condition with status True."""
    if not job:
        return None
    conds = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    if not conds:
        return None
    order = {"Failed": 5, "Succeeded": 4, "Suspended": 3, "Restarting": 2, "Running": 1, "Created": 0}
    # newest first; ties (same second) resolved by how final the state is
    conds.sort(key=lambda c: (c.get("lastTransitionTime") or c.get("lastUpdateTime") or "", order.get(c["type"], -1)))
    return conds[-1]["type"]
FINAL = ("Succeeded", "Failed")


def running_pods(pods: list[dict]) -> int:
    return sum(1 for p in pods if (p.get("status") or {}).get("phase") == "Running"
               and not (p.get("metadata") or {}).get("deletionTimestamp"))

