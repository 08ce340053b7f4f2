"""TrainingSpecs from Python, for notebooks and pipelines: the `kiln` command's cluster verbs as typed calls.

    from kiln.client import KilnClient

    client = KilnClient(namespace="ml")              # the kubeconfig as kubectl finds it, or in cluster
    spec = client.load("manifests/samples/quickstart.yaml")[0]   # or kiln.api.spec.TrainingSpec(...) built in code
    client.validate(spec)                            # the rules of `kiln validate` (KilnError naming the field)
    name = client.submit(spec)                       # create or update; returns the run's name
    status = client.wait(name, "Succeeded", timeout=7200)   # RunFailed, or TimeoutError, when it does not get there
    print(status.phase, status.step, status.goodput, status.cost)
    print(client.logs(name, tail=50))                # rank 0's log

The same errors as the CLI: `KilnError` (one line naming the cause) for bad specs, a refused apply or a missing
run; `RunFailed` for a run that ended otherwise than asked. Kubeflow's TrainerClient is the model for the shape
(submit, wait, logs), the TrainingSpec models (kiln.api.spec) for the types.

One module, one concern (the client; `job_of`, `worker_logging_steps` and `api_message` are its helpers that
`kiln logs` and `kiln wait` share). It sits beside kiln.cli, above kiln.control, which it imports: nothing below
imports it (api <- storage <- trainer/control <- cli/client).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Literal

from kiln.api.spec import TrainingSpec, TrainingSpecStatus
from kiln.errors import KilnError

Phase = Literal["Running", "Succeeded", "Suspended", "Failed"]
TERMINAL = ("Succeeded", "Failed")


class RunFailed(KilnError):
    """The run reached a phase it cannot leave (or another than the one waited for): its status says why."""

    def __init__(self, namespace: str, name: str, phase: str, wanted: str, message: str = ""):
        self.namespace, self.name, self.phase, self.wanted, self.message = namespace, name, phase, wanted, message
        super().__init__(f"{namespace}/{name}: {phase} (waited for {wanted}){': ' + message if message else ''}")


class KilnClient:
    """One namespace's TrainingSpecs on one cluster."""

    def __init__(self, namespace: str | None = None, *, kubeconfig: str | None = None, context: str | None = None,
                 kube=None):
        from kiln.control.kube import Kube, api_client

        self.kube = kube if kube is not None else Kube(api_client(kubeconfig, context))
        self.namespace = namespace or default_namespace(kubeconfig)

    # ---- specs ----

    @staticmethod
    def load(path: str | Path) -> list[TrainingSpec]:
        """The TrainingSpecs of a YAML file (several documents allowed), validated offline."""
        from kiln.api.load import load_file

        return load_file(str(path))

    @staticmethod
    def validate(spec: TrainingSpec, source: str = "spec") -> TrainingSpec:
        """The rules `kiln validate` applies for a cluster (the apiserver's too); KilnError names the field."""
        from kiln.api.load import check_cluster

        check_cluster(spec, source)
        return spec

    def submit(self, spec: TrainingSpec | str | Path) -> str:
        """Create the run, or update it to this spec; returns its name. A file may hold one spec only."""
        from kubernetes.client.exceptions import ApiException

        from kiln.api.load import dump_for_apply

        source = "spec"
        if not isinstance(spec, TrainingSpec):
            source, specs = str(spec), self.load(spec)
            if len(specs) != 1:
                raise KilnError(f"{source}: holds {len(specs)} TrainingSpecs; submit them one by one")
            spec = specs[0]
        self.validate(spec, source)
        spec = spec.model_copy(deep=True)
        spec.metadata.namespace = spec.metadata.namespace or self.namespace
        try:
            self.kube.apply(dump_for_apply(spec))
        except ApiException as err:
            raise KilnError(f"{source}: the apiserver refused {spec.metadata.name}: {api_message(err)}") from None
        return spec.metadata.name

    # ---- runs ----

    def get(self, name: str) -> dict:
        """The TrainingSpec object as the apiserver holds it."""
        body = self.kube.trainingspec(self.namespace, name)
        if body is None:
            raise KilnError(f"no TrainingSpec {name!r} in namespace {self.namespace}")
        return body

    def list(self) -> list[dict]:
        return self.kube.trainingspecs(self.namespace)

    def status(self, name: str) -> TrainingSpecStatus:
        return TrainingSpecStatus.model_validate(self.get(name).get("status") or {})

    def wait(self, name: str, until: Phase = "Succeeded", *, timeout: float = 7200.0,
             interval: float = 2.0) -> TrainingSpecStatus:
        """Poll until the run's phase is `until`; RunFailed if it ends in another, TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(name)
            if status.phase == until:
                return status
            if status.phase in TERMINAL:
                message = next((c.message or "" for c in status.conditions if c.type == status.phase), "")
                raise RunFailed(self.namespace, name, status.phase, until, message)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.namespace}/{name}: still {status.phase or 'Pending'} after {timeout:g} s "
                                   f"(waited for {until})")
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    def logs(self, name: str, *, worker: int | None = None, group: int | None = None, tail: int | None = None) -> str:
        """The log of the run's worker pod `worker` (default: the one whose log has the step lines, rank 0)."""
        from kubernetes.client.exceptions import ApiException

        job = job_of(self.kube, self.namespace, name, group)
        index = worker if worker is not None else worker_logging_steps(self.kube, self.namespace, name, job)
        pod = f"{job}-worker-{index}"
        try:
            return self.kube.logs(self.namespace, pod, tail=tail)
        except ApiException as err:
            if err.status == 404:
                raise KilnError(f"pod {self.namespace}/{pod} does not exist (yet); the run's phase is "
                                f"{self.status(name).phase or 'Pending'}") from None
            raise KilnError(f"cannot read logs of {self.namespace}/{pod}: {api_message(err)}") from None

    def delete(self, name: str) -> None:
        """Delete the run (its jobs and pods go with it; its checkpoints stay in the store)."""
        self.kube.custom.delete_namespaced_custom_object("kiln.dev", "v1alpha1", self.namespace, "trainingspecs", name)


STEP_LINE = re.compile(r"^step \d+/\d+", re.MULTILINE)  # kiln.trainer.observe.metrics prints these on rank 0 only


def job_of(kube, namespace: str, run: str, group: int | None) -> str:
    """The PyTorchJob whose pods hold the run's log: the run's, or with replica groups `<run>-g<group>` (group 0
    unless asked; each group's rank 0 logs its steps)."""
    from kiln.control.names import GROUP_LABEL, group_job_name

    if group is None and not any(GROUP_LABEL in (p["metadata"].get("labels") or {}) for p in kube.pods(namespace, run)):
        return run
    return group_job_name(run, group or 0)


def worker_logging_steps(kube, namespace: str, run: str, job: str | None = None) -> int:
    """The index of the worker pod (of `job`, default the run's) whose log has the trainer's step lines (its
    rank 0), else 0."""
    from kubernetes.client.exceptions import ApiException

    prefix = f"{job or run}-worker-"
    names = sorted((p["metadata"]["name"] for p in kube.pods(namespace, run)
                    if p["metadata"]["name"].startswith(prefix) and p["metadata"]["name"][len(prefix):].isdigit()),
                   key=lambda n: int(n[len(prefix):]))
    for name in names:
        try:
            if STEP_LINE.search(kube.logs(namespace, name, tail=200) or ""):
                return int(name[len(prefix):])
        except ApiException:
            continue  # not started yet, or gone
    return 0


def default_namespace(kubeconfig: str | None = None) -> str:
    """The kubeconfig context's namespace, else 'default' (as kubectl)."""
    from kubernetes import config as kconfig

    try:
        _, active = kconfig.list_kube_config_contexts(config_file=kubeconfig)
        return active.get("context", {}).get("namespace") or "default"
    except Exception:  # in cluster, or no kubeconfig: the API call will say what is missing
        return "default"


def api_message(err) -> str:
    """The apiserver's own message of a refused call."""
    import json

    try:
        return json.loads(err.body).get("message", err.reason)
    except (TypeError, ValueError):
        return f"{err.status} {err.reason}"
