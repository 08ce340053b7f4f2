"""The names and labels of a run's objects: one place, read by the plan, the status, the watches and `kiln`."""

from __future__ import annotations

RUN_LABEL = "kiln.dev/trainingspec"
GROUP_LABEL = "kiln.dev/replica-group"  # replicaGroups: the group a trainer pod (and its PyTorchJob) belongs to
# The lighthouse pod is labelled apart from the trainer pods (not RUN_LABEL): it is no node of the run, so the
# status, the elastic loop and the pod watch, which all count the run's pods by RUN_LABEL, never see it.
LIGHTHOUSE_LABEL = "kiln.dev/lighthouse"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kiln"}


def names(run: str) -> dict[str, str]:
    return {"job": run, "configmap": f"{run}-spec", "trainer": f"{run}-trainer", "lighthouse": f"{run}-lighthouse"}


def job_names(run: str, groups: int = 1) -> list[str]:
    """The run's PyTorchJobs: `<run>`, or with replica groups `<run>-g0` .. `<run>-g<groups-1>`."""
    return [run] if groups <= 1 else [group_job_name(run, i) for i in range(groups)]


def group_job_name(run: str, group: int) -> str:
    """The PyTorchJob of one replica group."""
    return f"{run}-g{group}"
