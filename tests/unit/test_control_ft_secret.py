"""The per-run secret of a run with replica groups (kiln.control.ft_secret): what plan() renders, and how the
operator's Kube creates it (once, with a value drawn then, never applied again)."""

from __future__ import annotations

import base64
import copy
import json

import pytest
from kubernetes.client.exceptions import ApiException

from kiln.api import contract
from kiln.control import ft_secret
from kiln.control.kube import Kube

from tests.support.groups import GROUPS, UID, of, rendered


def pod_specs(objects: list[dict]) -> dict[str, dict]:
    """Every pod template the objects make: the groups' workers and the lighthouse, by object name."""
    out = {j["metadata"]["name"]: j["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
           for j in of(objects, "PyTorchJob")}
    out |= {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in of(objects, "Deployment")}
    return out


def secrets_referenced(pod: dict) -> set[str]:
    """Every Secret a pod spec names: volumes and environment (secretKeyRef)."""
    names = {v["secret"]["secretName"] for v in pod.get("volumes") or [] if "secret" in v}
    for c in pod["containers"]:
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env") or []
                  if "secretKeyRef" in (e.get("valueFrom") or {})}
    return names


def test_a_run_with_groups_gets_its_own_secret_owned_by_it_and_without_a_value_in_the_plan():
    objects = rendered()
    [secret] = of(objects, "Secret")
    meta = secret["metadata"]
    assert meta["name"] == "ft-ft" and meta["namespace"] == "ml" and secret["type"] == "Opaque"
    assert meta["ownerReferences"] == [{"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "name": "ft",
                                        "uid": UID, "controller": True, "blockOwnerDeletion": True}]
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "kiln"  # the admission policy lets the operator write it
    assert "data" not in secret and "stringData" not in secret  # drawn when created (Kube.create_once)
    kinds = [o["kind"] for o in objects]
    assert kinds.index("Secret") < kinds.index("Deployment") < kinds.index("PyTorchJob")
    assert rendered() == objects  # the plan stays pure: the same objects every reconcile


def test_only_the_runs_groups_and_its_lighthouse_mount_it_as_a_file():
    pods = pod_specs(rendered())
    assert set(pods) == {"ft-g0", "ft-g1", "ft-lighthouse"}
    for name, pod in pods.items():
        assert "ft-ft" in secrets_referenced(pod), name
        [volume] = [v for v in pod["volumes"] if v["name"] == ft_secret.VOLUME]
        assert volume["secret"]["items"] == [{"key": contract.FT_SECRET_KEY, "path": contract.FT_SECRET_KEY}]
        [container] = pod["containers"]
        assert {"name": ft_secret.VOLUME, "mountPath": contract.FT_SECRET_MOUNT, "readOnly": True} in \
            container["volumeMounts"]
        if name == "ft-lighthouse":  # it serves its port through the tunnel, reading the secret there
            assert container["command"][container["command"].index("--secret_file") + 1] == ft_secret.FILE
            assert secrets_referenced(pod) == {"ft-ft"}
        else:
            assert {"name": contract.FT_SECRET_FILE, "value": ft_secret.FILE} in container["env"]
            assert secrets_referenced(pod) == {"ft-ft", "s3"}  # and the checkpoint's keys, as without groups
    # another run in the same namespace: its own secret, never this one
    other = copy.deepcopy(GROUPS)
    other["metadata"].update(name="other", uid="5b1c8e0c-0000-4000-8000-000000000009")
    other_objects = rendered(other)
    assert [s["metadata"]["name"] for s in of(other_objects, "Secret")] == ["other-ft"]
    for name, pod in pod_specs(other_objects).items():
        assert "ft-ft" not in secrets_referenced(pod) and "other-ft" in secrets_referenced(pod), name


def test_a_run_without_groups_has_no_secret_and_mounts_none():
    off = copy.deepcopy(GROUPS)
    off["spec"]["elastic"]["faultTolerance"]["mode"] = "off"
    objects = rendered(off)
    assert not of(objects, "Secret")
    [pod] = pod_specs(objects).values()
    assert secrets_referenced(pod) == {"s3"}
    assert contract.FT_SECRET_FILE not in {e["name"] for e in pod["containers"][0]["env"]}


class FakeApi:
    """What Kube.create_once sends; answers with `status` (None: created)."""

    def __init__(self, status: int | None = None):
        self.calls, self.status = [], status

    def call_api(self, path, method, **kw):
        self.calls.append((path, method, kw))
        if self.status is not None:
            raise ApiException(status=self.status, reason="nope")


def secret_object() -> dict:
    [secret] = of(rendered(), "Secret")
    return secret


def test_the_operator_creates_the_secret_once_with_32_random_bytes_and_never_writes_it_again():
    kube = Kube(FakeApi(), resync_seconds=300)
    kube.apply(secret_object())
    [(path, method, kw)] = kube.api.calls
    assert (path, method) == ("/api/v1/namespaces/ml/secrets", "POST")  # a create: never a patch or an apply
    value = base64.b64decode(kw["body"]["data"][contract.FT_SECRET_KEY]).decode()
    assert len(bytes.fromhex(value)) == 32
    assert kw["body"]["metadata"]["ownerReferences"][0]["uid"] == UID
    kube.apply(secret_object())  # the next reconcile: nothing sent
    assert len(kube.api.calls) == 1
    kube.forget_applied("ml", "ft")  # a resync: created again if it was deleted; a new value each time it is drawn
    kube.apply(secret_object())
    assert len(kube.api.calls) == 2
    assert json.dumps(kube.api.calls[1][2]["body"]["data"]) != json.dumps(kw["body"]["data"])


def test_an_existing_secret_is_kept_and_any_other_refusal_is_raised():
    kube = Kube(FakeApi(status=409))
    kube.apply(secret_object())  # it exists: the running groups hold its value, so it stays
    kube = Kube(FakeApi(status=403))
    with pytest.raises(ApiException):
        kube.apply(secret_object())
