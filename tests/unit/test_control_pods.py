"""spec.pod and spec.network rendered into the trainer pods, under the admin policy (kiln.control.pods,
kiln.control.network, kiln.control.policy). The apiserver's own verdict on the rendered pods (validity, Pod
Security levels) is tests/integration/test_operator_pods.py; the kubelet's, tests/e2e/test_real_node_pods.py."""

from __future__ import annotations

import pytest

from kiln.api import contract
from kiln.api.load import parse
from kiln.control import pods
from kiln.control.config import OperatorConfig
from kiln.control.plan import Observed, plan
from kiln.control.policy import AdminPolicy
from kiln.errors import KilnError
from tests.pod_settings import CLOSED, EVERYTHING, OPEN
from tests.support.specs import doc_of, with_, worker


def planned(raw: dict, policy: AdminPolicy = OPEN, observed: Observed | None = None):
    return plan(doc_of(raw), observed, OperatorConfig(image="registry.test/trainer:1", policy=policy))


def pod_of(result) -> dict:
    assert result.refused is None, result.refused
    return worker(next(o for o in result.objects if o["kind"] == "PyTorchJob"))["template"]["spec"]


def env_of(pod: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}


def test_every_pod_setting_reaches_the_pod_with_kubernetes_field_names():
    result = planned(with_({"pod": EVERYTHING}))
    pod = pod_of(result)
    (c,) = pod["containers"]
    env = env_of(pod)
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["WANDB_PROJECT"] == {"configMapKeyRef": {"name": "site", "key": "project", "optional": True}}
    assert env["KILN_RUN_NAME"] == "base"  # kiln's own still there
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cache"]["persistentVolumeClaim"] == {"claimName": "hf-cache"}
    assert volumes["site"]["configMap"] == {"name": "site"}
    assert volumes["creds"]["secret"] == {"secretName": "creds", "defaultMode": 0o400}
    assert volumes["fast"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert volumes["bucket"]["csi"] == {"driver": "s3.csi.aws.com", "readOnly": True,
                                        "volumeAttributes": {"bucketName": "b"}}
    assert volumes["ds"]["hostPath"] == {"path": "/mnt/datasets/shared", "type": "Directory"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["site"] == {"name": "site", "mountPath": "/etc/site", "readOnly": True}
    assert mounts["ds"] == {"name": "ds", "mountPath": "/data", "subPath": "c4"}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["serviceAccountName"] == "team-irsa" and pod["runtimeClassName"] == "nvidia"
    assert pod["hostNetwork"] is True and pod["hostIPC"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # the rendezvous Service still resolves
    res = c["resources"]
    assert res["requests"]["rdma/ib"] == res["limits"]["rdma/ib"] == "1"
    assert res["limits"]["hugepages-2Mi"] == "5120Mi"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    # the run's status Role reaches the pods' own ServiceAccount too
    binding = next(o for o in result.objects if o["kind"] == "RoleBinding")
    assert {"kind": "ServiceAccount", "name": "team-irsa"} in binding["subjects"]
    # what breaks `restricted` is said, with the namespace label it needs
    assert any("Pod Security level privileged" in n and "pod-security.kubernetes.io/enforce: privileged" in n
               and "hostPath volume ds" in n and "capability IPC_LOCK" in n for n in result.notes), result.notes


def test_nothing_set_keeps_the_pod_as_before():
    pod = pod_of(planned(with_({})))
    assert "hostNetwork" not in pod and "imagePullSecrets" not in pod and "runtimeClassName" not in pod
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["serviceAccountName"] == "base-trainer"


@pytest.mark.parametrize("pod_settings, field", [
    ({"volumes": [{"name": "h", "mountPath": "/h", "hostPath": {"path": "/etc"}}]}, "spec.pod.volumes[0].hostPath.path"),
    # a prefix allows its folder and below, never a sibling that merely starts the same
    ({"volumes": [{"name": "h", "mountPath": "/h", "hostPath": {"path": "/mnt/datasets2"}}]},
     "spec.pod.volumes[0].hostPath.path"),
    ({"capabilities": ["SYS_ADMIN"]}, "spec.pod.capabilities[0]"),
    ({"extraResources": [{"name": "example.com/fpga", "quantity": "1"}]}, "spec.pod.extraResources[0]"),
])


def test_dangerous_settings_outside_the_policy_are_refused_by_field_with_nothing_applied(pod_settings, field):
    result = planned(with_({"pod": pod_settings}))
    assert result.objects == [] and result.refused_reason == "ForbiddenByPolicy"
    assert result.refused.startswith(field), result.refused


@pytest.mark.parametrize("pod_settings, field", [
    ({"volumes": [{"name": "h", "mountPath": "/h", "hostPath": {"path": "/mnt/datasets"}}]},
     "spec.pod.volumes[0].hostPath.path"),
    ({"capabilities": ["IPC_LOCK"]}, "spec.pod.capabilities[0]"),
    ({"hostNetwork": True}, "spec.pod.hostNetwork"),
    ({"hostIPC": True}, "spec.pod.hostIPC"),
    ({"extraResources": [{"name": "rdma/ib", "quantity": "1"}]}, "spec.pod.extraResources[0]"),
])


def test_the_default_policy_refuses_each_and_the_sites_policy_allows_it(pod_settings, field):
    refused = planned(with_({"pod": pod_settings}), CLOSED)
    assert refused.objects == [] and refused.refused.startswith(field), refused.refused
    assert pod_of(planned(with_({"pod": pod_settings}), OPEN))


def test_service_accounts_may_be_limited_by_the_policy():
    raw = with_({"pod": {"serviceAccountName": "admin"}})
    assert pod_of(planned(raw, CLOSED))["serviceAccountName"] == "admin"  # empty list: any in the namespace
    limited = planned(raw, AdminPolicy(allowed_service_accounts=("team-irsa",)))
    assert limited.refused.startswith("spec.pod.serviceAccountName: 'admin'")


def test_policy_reads_its_pod_limits_from_the_environment():
    policy = AdminPolicy.from_env({"KILN_POLICY_HOST_PATH_PREFIXES": "/mnt/datasets, /scratch",
                                   "KILN_POLICY_CAPABILITIES": "IPC_LOCK", "KILN_POLICY_EXTRA_RESOURCES": "rdma/",
                                   "KILN_POLICY_ALLOW_HOST_NETWORK": "true", "KILN_POLICY_SERVICE_ACCOUNTS": "a,b"})
    assert policy.allowed_host_path_prefixes == ("/mnt/datasets", "/scratch")
    assert policy.allowed_capabilities == ("IPC_LOCK",) and policy.allowed_extra_resources == ("rdma/",)
    assert policy.allow_host_network and not policy.allow_host_ipc
    assert policy.allowed_service_accounts == ("a", "b")


def test_kilns_own_env_names_are_refused_by_name_offline():
    for name in ("PET_NNODES", "KILN_RUN_NAME", "MASTER_ADDR", "TMPDIR", "AWS_SECRET_ACCESS_KEY"):
        with pytest.raises(KilnError, match=name):
            parse(with_({"pod": {"env": [{"name": name, "value": "x"}]}}))
    parse(with_({"pod": {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "OMP_NUM_THREADS", "value": "8"}]}}))


def test_every_variable_kiln_sets_is_reserved():
    """A user's pod.env can never replace what kiln's plan sets, in any configuration that adds variables."""
    raw = with_({"elastic": {"faultTolerance": {"mode": "replicaGroups", "groups": 2}}, "resources.nodes": 2,
                 "checkpoint": {"uri": "s3://b/r/", "endpoint": "http://s3:9000", "credentialsSecret": "s3"},
                 "tracking": {"mlflow": {"uri": "http://mlflow:5000", "credentialsSecret": "ml"},
                              "wandb": {"project": "p", "credentialsSecret": "wb"}}})
    for body in (with_({}), raw):
        result = planned(body)
        for job in (o for o in result.objects if o["kind"] == "PyTorchJob"):
            names = set(env_of(worker(job)["template"]["spec"]))
            unreserved = {n for n in names if not (n in contract.RESERVED_ENV
                                                   or n.startswith(contract.RESERVED_ENV_PREFIXES))}
            assert unreserved <= set(contract.GPU_POD_ENV), unreserved  # defaults a user may change


@pytest.mark.parametrize("volume, says", [
    ({"name": "dshm", "mountPath": "/x", "emptyDir": {}}, "kiln's own"),
    ({"name": "x", "mountPath": "/etc/kiln", "emptyDir": {}}, "kiln's own"),
    ({"name": "x", "mountPath": "/x", "emptyDir": {}, "secret": {"secretName": "s"}}, "exactly one"),
    ({"name": "x", "mountPath": "/x", "hostPath": {"path": "/mnt/datasets/../../etc"}}, "'..'"),
])


def test_volumes_that_would_break_the_pod_are_refused_offline(volume, says):
    with pytest.raises(KilnError, match=says):
        parse(with_({"pod": {"volumes": [volume]}}))


def test_security_level_is_restricted_unless_asked_otherwise():
    def level(pod_settings: dict, network: dict | None = None) -> str:
        return pods.security_level(parse(with_({"pod": pod_settings, "network": network})).spec)[0]

    assert level({}) == "restricted"
    assert level({"volumes": [{"name": "c", "mountPath": "/c", "persistentVolumeClaim": {"claimName": "c"}}],
                  "runtimeClassName": "nvidia",
                  "extraResources": [{"name": "rdma/ib", "quantity": "1"}]}) == "restricted"
    assert level({"capabilities": ["NET_BIND_SERVICE"]}) == "restricted"
    assert level({"capabilities": ["CHOWN"]}) == "baseline"
    assert level({"capabilities": ["IPC_LOCK"]}) == "privileged"
    assert level({}, {"fabric": "infiniband"}) == "privileged"  # the preset's IPC_LOCK
    assert level({}, {"fabric": "efa"}) == "restricted"
    assert level({"hostIPC": True}) == "privileged"


# ---- network presets: what each vendor's documentation asks of a pod (sources in kiln.control.network) ----

def test_tcp_keeps_nccl_on_sockets_over_the_named_interface():
    # NCCL env docs: NCCL_IB_DISABLE=1 "prevents the IB/RoCE transport from being used"; NCCL_SOCKET_IFNAME
    # picks the interfaces by prefix
    pod = pod_of(planned(with_({"network": {"fabric": "tcp", "socketInterface": "eth0"}})))
    env = env_of(pod)
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert set(pod["containers"][0]["resources"]["limits"]) <= {"nvidia.com/gpu", "memory", "ephemeral-storage"}


@pytest.mark.parametrize("fabric", ["infiniband", "roce"])
def test_rdma_fabrics_request_the_shared_rdma_device_and_ipc_lock(fabric):
    # NVIDIA Network Operator: the RDMA shared device plugin's resource (default rdma/rdma_shared_device_a)
    # and IPC_LOCK in the container's capabilities; NCCL env docs: NCCL_IB_GID_INDEX selects RoCE's GID
    net = {"fabric": fabric, "devices": 2, **({"gidIndex": 3} if fabric == "roce" else {})}
    c = pod_of(planned(with_({"network": net})))["containers"][0]
    assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == "2"
    assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == "2"
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    env = env_of({"containers": [c]})
    assert env["NCCL_IB_DISABLE"] == "0"
    assert env.get("NCCL_IB_GID_INDEX") == ("3" if fabric == "roce" else None)


def test_efa_requests_the_efa_devices_and_sets_libfabrics_provider():
    # EKS "Run machine learning training on Amazon EKS with Elastic Fabric Adapter": the pod requests
    # vpc.amazonaws.com/efa from the EFA device plugin; aws-ofi-nccl: libfabric provider efa, and
    # FI_EFA_USE_DEVICE_RDMA=1 for GPUDirect RDMA on p4d/p5
    c = pod_of(planned(with_({"network": {"fabric": "efa", "devices": 32}})))["containers"][0]
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"
    env = env_of({"containers": [c]})
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # the device plugin hands over the devices


def test_a_users_env_overrides_a_presets_value_once():
    pod = pod_of(planned(with_({"network": {"fabric": "infiniband"},
                                "pod": {"env": [{"name": "NCCL_IB_DISABLE", "value": "1"}]}})))
    values = [e.get("value") for e in pod["containers"][0]["env"] if e["name"] == "NCCL_IB_DISABLE"]
    assert values == ["1"]


def test_gpu_pods_size_the_nccl_flight_recorder_and_a_users_env_may_change_it():
    assert env_of(pod_of(planned(with_({}))))["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"  # dumped on a hang
    cpu = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "cpu"}, "spec": {}}
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env_of(pod_of(planned(cpu)))
    pod = pod_of(planned(with_({"pod": {"env": [{"name": "TORCH_NCCL_TRACE_BUFFER_SIZE", "value": "0"}]}})))
    assert [e.get("value") for e in pod["containers"][0]["env"] if e["name"] == "TORCH_NCCL_TRACE_BUFFER_SIZE"] == ["0"]


def test_a_presets_device_and_capability_go_through_the_policy():
    result = planned(with_({"network": {"fabric": "infiniband"}}), CLOSED)
    assert result.objects == []
    assert "spec.network.fabric (infiniband needs it): capability IPC_LOCK" in result.refused
    assert "spec.network.fabric (infiniband requests it): resource rdma/rdma_shared_device_a" in result.refused


def test_a_device_the_queue_does_not_cover_is_refused_by_field():
    from kiln.control import kueue

    cov = kueue.Coverage("gpus", frozenset({"cpu", "memory", "ephemeral-storage", "nvidia.com/gpu"}))
    rdma = {"extraResources": [{"name": "rdma/ib", "quantity": "1"}]}
    result = planned(with_({"scheduling.queue": "team", "pod": rdma}),
                     observed=Observed(queue_coverage=cov))
    assert result.refused_reason == "NotCoveredByQueue"
    assert result.refused.startswith("spec.pod.extraResources[0]: the pods request rdma/ib")


# ---- gang placement, honestly: the condition names what holds ----

@pytest.mark.parametrize("scheduling, expected", [
    ({"queue": "team", "topology": {"level": "rack"}}, ("True", "KueueAdmission", "free capacity")),
    ({"queue": "team"}, ("True", "KueueAdmission", "quota only")),
    ({}, ("False", "NoGangScheduler", "default kube-scheduler")),
    ({"gang": False}, ("False", "Disabled", "one by one")),
])


def test_the_gang_condition_says_what_holds(scheduling, expected):
    from kiln.control.status import derive

    ts = {"metadata": {"name": "r", "generation": 1}, "spec": {"scheduling": scheduling}, "status": {}}
    d = derive(ts, None, [], "2026-01-01T00:00:00Z", accepted=("True", "Applied", "ok"))
    gang = next(c for c in d.status["conditions"] if c["type"] == "Gang")
    assert (gang["status"], gang["reason"]) == expected[:2] and expected[2] in gang["message"], gang


def test_the_lighthouse_pulls_the_trainer_image_with_the_same_secrets():
    raw = with_({"resources.nodes": 2, "elastic": {"faultTolerance": {"mode": "replicaGroups", "groups": 2}},
                 "pod": {"imagePullSecrets": [{"name": "regcred"}]}})
    deployment = next(o for o in planned(raw).objects if o["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


def test_extra_resources_are_extended_resources_named_once():
    for bad, says in (([{"name": "nvidia.com/gpu", "quantity": "1"}], "set in resources"),
                      ([{"name": "ib", "quantity": "1"}], "pattern"),
                      ([{"name": "rdma/ib", "quantity": "lots"}], "pattern"),
                      ([{"name": "rdma/ib", "quantity": "1"}, {"name": "rdma/ib", "quantity": "2"}], "once")):
        with pytest.raises(KilnError, match=says):
            parse(with_({"pod": {"extraResources": bad}}))
