"""The per-run secret of a run with replica groups (issue 28, authenticated healing). Pure: no I/O, no randomness.

The lighthouse admits a group's connection only after it proved it holds the run's secret
(kiln.trainer.membership.auth). The operator makes one Secret `<run>-ft` per such run, owned by the
TrainingSpec (the garbage collector deletes it with the run), and mounts it as a file into that run's pods and
its lighthouse only. The Secret carries no value here: plan() stays pure and the same on every reconcile.
Kube.create_once draws the value when it creates the Secret and never writes it again (the operator may
create Secrets, not read or patch them: an apply would draw a new value at every reconcile and lock the running
groups out).
"""

from __future__ import annotations

from kiln.api import contract
from kiln.control.k8s import K8S_MODELS as k

VOLUME = "kiln-ft"
FILE = f"{contract.FT_SECRET_MOUNT}/{contract.FT_SECRET_KEY}"


def name(run: str) -> str:
    return f"{run}-ft"


def secret(run: str, metadata) -> dict:
    """The Secret as the operator creates it (Kube.create_once adds the value): only its name and owner."""
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata(name(run)), "type": "Opaque"}


def volume(run: str) -> k.V1Volume:
    # 0444: the pod's uid is the image's (kiln's 10001), the file's owner root; the pod holds nothing else
    return k.V1Volume(name=VOLUME, secret=k.V1SecretVolumeSource(
        secret_name=name(run), items=[k.V1KeyToPath(key=contract.FT_SECRET_KEY, path=contract.FT_SECRET_KEY)],
        default_mode=0o444))


def mount() -> k.V1VolumeMount:
    return k.V1VolumeMount(name=VOLUME, mount_path=contract.FT_SECRET_MOUNT, read_only=True)
