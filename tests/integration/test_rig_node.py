"""The rig's real node: pods run in containers, reach each other by DNS, the apiserver through
the `kubernetes` Service, and the rig's S3; `kubectl logs` and `exec` work.

Every pod runs the node's own probe image (tests/rig/go/probe, a static binary) with
`imagePullPolicy: Never`: nothing is pulled.
"""

from __future__ import annotations

import io
import json
import uuid

import pytest
from minio import Minio

from tests.rig import cluster, versions

pytestmark = pytest.mark.rig


def probe_pod(node, namespace: str, name: str, args: list[str], labels: dict | None = None,
              restart: str = "Never") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {
            "restartPolicy": restart,
            "nodeSelector": node.node_selector,
            "tolerations": [node.toleration],
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "probe", "image": node.probe_image, "imagePullPolicy": "Never",
                            "args": args, "env": [{"name": "PROBE_TIMEOUT", "value": "90"}]}],
        },
    }


def pod(rig, namespace: str, name: str) -> dict:
    return json.loads(rig.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)


def run_to_completion(rig, namespace: str, manifest: dict, timeout: float = 180) -> str:
    """Create the pod, wait until it Succeeded (failing at once, with its logs, if it Failed); its logs."""
    rig.apply(manifest)
    name = manifest["metadata"]["name"]

    def finished():
        phase = pod(rig, namespace, name)["status"].get("phase")
        if phase == "Failed":
            logs = rig.kubectl("logs", name, "-n", namespace, check=False)
            pytest.fail(f"pod {name} failed: {logs.stdout}{logs.stderr}")
        return phase == "Succeeded"

    rig.wait_for(f"pod {name} Succeeded", finished, timeout=timeout)
    return rig.kubectl("logs", name, "-n", namespace).stdout


def wait_running(rig, namespace: str, name: str, timeout: float = 180) -> dict:
    def ready():
        p = pod(rig, namespace, name)
        statuses = p["status"].get("containerStatuses", [])
        return p if statuses and all(s.get("ready") for s in statuses) else None

    return rig.wait_for(f"pod {name} Ready", ready, timeout=timeout)


def test_node_registers_ready_tainted_beside_the_kwok_nodes(rig, real_node):
    node = json.loads(rig.kubectl("get", "node", real_node.name, "-o", "json").stdout)
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", ready
    info = node["status"]["nodeInfo"]
    # Built with the apiserver's version ldflags, not v0.0.0-master.
    assert info["kubeletVersion"] == versions.KUBERNETES
    assert info["containerRuntimeVersion"] == f"containerd://{versions.CONTAINERD.removeprefix('v')}"
    assert {"type": "InternalIP", "address": real_node.ip} in node["status"]["addresses"]
    assert real_node.taint in node["spec"]["taints"]
    assert all(node["metadata"]["labels"].get(k) == v for k, v in real_node.labels.items())
    # The kwok GPU nodes are still there and Ready.
    assert all(rig.node_ready(n) for n in rig.gpu_nodes)


def test_a_pod_without_the_toleration_is_not_scheduled_there(rig, real_node, namespace):
    manifest = probe_pod(real_node, namespace, "untolerated", ["echo", "never"])
    manifest["spec"]["tolerations"] = []
    rig.apply(manifest)

    def unschedulable():
        cond = next((c for c in pod(rig, namespace, "untolerated")["status"].get("conditions", [])
                     if c["type"] == "PodScheduled"), {})
        return cond if cond.get("reason") == "Unschedulable" else None

    cond = rig.wait_for("the scheduler's verdict", unschedulable, timeout=60)
    # The only node its selector allows refuses it for its taint (the scheduler counts the other tainted pools,
    # such as Kueue's topology pool, in the same sentence: the count is not this node's alone).
    assert "had untolerated taint" in cond["message"], cond
    assert not pod(rig, namespace, "untolerated")["spec"].get("nodeName")


def test_a_pod_runs_to_completion_and_kubectl_logs_shows_its_output(rig, real_node, namespace):
    word = uuid.uuid4().hex
    logs = run_to_completion(rig, namespace, probe_pod(real_node, namespace, "hello", ["echo", "hello", word]))
    assert logs.strip() == f"hello {word}"
    status = pod(rig, namespace, "hello")["status"]
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("Completed", 0)
    assert status["podIP"].startswith(real_node.ip.rsplit(".", 1)[0] + ".")  # on the node's bridge


def test_kubectl_exec_runs_a_command_in_the_container(rig, real_node, namespace):
    rig.apply(probe_pod(real_node, namespace, "server", ["serve", "8080"], restart="Always"))
    wait_running(rig, namespace, "server")
    out = rig.kubectl("exec", "server", "-n", namespace, "--", "/probe", "resolve", "kubernetes.default")
    assert out.stdout.strip() == cluster.KUBERNETES_SERVICE_IP  # the `kubernetes` Service, through CoreDNS


def test_pods_reach_each_other_by_headless_and_clusterip_service_names(rig, real_node, namespace):
    # As the training-operator does for MASTER_ADDR: a headless Service selecting the master pod.
    rig.apply(probe_pod(real_node, namespace, "master-0", ["serve", "23456"], labels={"role": "master"},
                        restart="Always"))
    ports = [{"name": "c10d", "port": 23456, "targetPort": 23456}]
    rig.apply([
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "job-master-0", "namespace": namespace},
         "spec": {"clusterIP": "None", "selector": {"role": "master"}, "ports": ports}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "job-vip", "namespace": namespace},
         "spec": {"selector": {"role": "master"}, "ports": ports}},
    ])
    master_ip = wait_running(rig, namespace, "master-0")["status"]["podIP"]

    logs = run_to_completion(rig, namespace, probe_pod(real_node, namespace, "resolve", ["resolve", "job-master-0"]))
    assert logs.strip() == master_ip  # a headless Service resolves to the pod itself
    worker = probe_pod(real_node, namespace, "worker", ["connect", "job-master-0:23456"])
    logs = run_to_completion(rig, namespace, worker)
    assert logs.strip() == "hello from master-0"
    # A ClusterIP Service: kube-proxy's rules lead to the same pod.
    fqdn = f"job-vip.{namespace}.svc.cluster.local:23456"
    logs = run_to_completion(rig, namespace, probe_pod(real_node, namespace, "vip", ["connect", fqdn]))
    assert logs.strip() == "hello from master-0"


def test_a_pod_reaches_the_apiserver_through_the_kubernetes_service(rig, real_node, namespace):
    logs = run_to_completion(rig, namespace, probe_pod(real_node, namespace, "whoami", ["whoami"]))
    # In-cluster config (KUBERNETES_SERVICE_HOST, the mounted token and CA) authenticated the pod.
    assert logs.strip() == f"system:serviceaccount:{namespace}:default"


def test_a_pod_reaches_the_rigs_s3(rig, real_node, namespace):
    key = f"{namespace}/from-a-pod.txt"
    body = uuid.uuid4().hex.encode()
    rig.minio_client().put_object(rig.s3_bucket, key, io.BytesIO(body), len(body))
    # A URL signed for the address pods use (the bridge), so the pod needs no credentials.
    pods_view = Minio(real_node.s3_endpoint.removeprefix("http://"), access_key=rig.s3_access_key,
                      secret_key=rig.s3_secret_key, secure=False, region="us-east-1")
    url = pods_view.presigned_get_object(rig.s3_bucket, key)
    try:
        logs = run_to_completion(rig, namespace, probe_pod(real_node, namespace, "s3", ["get", url]))
    finally:
        rig.minio_client().remove_object(rig.s3_bucket, key)
    assert logs.strip() == f"200 {body.decode()}"


def test_a_pod_security_restricted_pod_runs(rig, real_node, namespace):
    # What kiln's trainer pods need: admitted under `restricted`, run by runc with the runtime's
    # default seccomp profile, as non-root, read-only root, no capabilities, a sized /dev/shm.
    rig.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    manifest = probe_pod(real_node, namespace, "restricted", ["echo", "restricted"])
    manifest["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 65534,
                                           "seccompProfile": {"type": "RuntimeDefault"}}
    manifest["spec"]["containers"][0] |= {
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }
    manifest["spec"]["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}]
    assert run_to_completion(rig, namespace, manifest).strip() == "restricted"


def test_a_rebuilt_image_leaves_nothing_of_the_old_one_once_untagged_images_are_removed(real_node, tmp_path):
    # Each rebuild of the 7 GB trainer image moves its tag; the CRI's `sha256:<id>` record of the old
    # one kept it on disk until the disk filled (a CI run failed so). Two builds of one name here.
    from tests.rig import build, oci

    name = f"localhost/kiln-test/rebuilt-{uuid.uuid4().hex[:6]}:1"
    ids = []
    for build_no in (1, 2):
        marker = tmp_path / f"marker-{build_no}"
        marker.write_text(f"build {build_no}")
        tar = tmp_path / f"rebuilt-{build_no}.tar"
        oci.image_archive(name, {"/probe": build.node_bin_dir() / "probe", "/marker": marker}, ["/probe"], tar)
        real_node.import_image(tar)
        listed = json.loads(real_node.crictl("inspecti", "-o", "json", name).stdout)
        ids.append(listed["status"]["id"])
    assert ids[0] != ids[1]

    def image_ids() -> dict[str, list[str]]:
        listed = json.loads(real_node.crictl("images", "-o", "json").stdout)["images"]
        return {image["id"]: image.get("repoTags") or [] for image in listed}

    assert image_ids().get(ids[0]) == [], "the first build should be held by its id alone"
    removed = real_node.remove_untagged_images()
    held = image_ids()
    assert ids[0] in removed and ids[0] not in held
    assert held[ids[1]] == [name]
    assert any("kiln-rig/pause" in tag for tags in held.values() for tag in tags), "the sandbox image must stay"
    real_node.crictl("rmi", ids[1])
