"""plan(): a TrainingSpec → ServiceAccount/Role/RoleBinding, ConfigMap (resolved spec), PyTorchJob."""

from __future__ import annotations

import pytest
import yaml
from kubeflow.training import ApiClient, models as k

from kiln.api.load import parse
from kiln.cli.main import build_parser, main
from kiln.control.config import OperatorConfig
from kiln.control.plan import KUEUE_PRIORITY_LABEL, KUEUE_QUEUE_LABEL, Observed, dump, plan, resolve
from kiln.errors import KilnError
from tests.support.specs import BASE, UID, doc_of, with_, worker


def objects(raw: dict, observed: Observed | None = None, config: OperatorConfig | None = None) -> dict:
    result = plan(doc_of(raw), observed, config or OperatorConfig(image="registry.test/trainer:1"))
    assert result.refused is None
    return {o["kind"]: o for o in result.objects}


def test_pytorchjob_carries_gpus_selector_elastic_and_command():
    job = objects(BASE)["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1" and job["metadata"]["name"] == "base"
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8"
    assert spec["elasticPolicy"] == {"minReplicas": 1, "maxReplicas": 4, "rdzvBackend": "c10d", "rdzvPort": 29400,
                                     "maxRestarts": 10}
    assert worker(job)["replicas"] == 2
    pod = worker(job)["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "pytorch" and c["image"] == "registry.test/trainer:1"
    assert c["command"] == ["kiln", "torchrun", "-m", "kiln.cli.warm", "train",
                            "--config", "/etc/kiln/spec.yaml", "--output", "/var/lib/kiln/run"]
    assert build_parser().parse_args(c["command"][4:]).command == "train"  # the warm launcher runs `kiln train`
    # no cpu/memory in the spec: the operator's defaults (a cpu request, memory request = limit)
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "8", "memory": "4Gi", "ephemeral-storage": "50Gi"},
                              "requests": {"nvidia.com/gpu": "8", "memory": "4Gi", "ephemeral-storage": "50Gi",
                                           "cpu": "1"}}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["serviceAccountName"] == "base-trainer"
    assert {"name": "spec", "configMap": {"name": "base-spec"}} in pod["volumes"]


def test_run_policy_gang_suspend_and_queue():
    job = objects(with_({"suspend": True, "scheduling": {"queue": "team-a", "priorityClassName": "high"}}))["PyTorchJob"]
    rp = job["spec"]["runPolicy"]
    assert rp["suspend"] is True and rp["backoffLimit"] == 10 and rp["cleanPodPolicy"] == "None"
    assert rp["schedulingPolicy"] == {"minAvailable": 1, "queue": "team-a", "priorityClass": "high"}
    assert job["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-a"
    assert worker(job)["template"]["spec"]["priorityClassName"] == "high"
    # Not suspended and queued: Kueue owns runPolicy.suspend, kiln leaves it out of its apply.
    rp = objects(with_({"scheduling": {"queue": "team-a"}}))["PyTorchJob"]["spec"]["runPolicy"]
    assert "suspend" not in rp
    assert objects(BASE)["PyTorchJob"]["spec"]["runPolicy"]["suspend"] is False


def test_kueue_priority_is_a_label_apart_from_the_pod_priority_class():
    job = objects(with_({"scheduling": {"queue": "team-a", "priority": "urgent", "priorityClassName": "high"}}))[
        "PyTorchJob"]
    assert job["metadata"]["labels"][KUEUE_PRIORITY_LABEL] == "urgent"
    assert worker(job)["template"]["spec"]["priorityClassName"] == "high"
    assert KUEUE_PRIORITY_LABEL not in (objects(BASE)["PyTorchJob"]["metadata"].get("labels") or {})


@pytest.mark.parametrize("mode,annotation", [("required", "kueue.x-k8s.io/podset-required-topology"),
                                             ("preferred", "kueue.x-k8s.io/podset-preferred-topology")])


def test_topology_renders_kueues_pod_set_annotation_on_the_worker_template(mode, annotation):
    job = objects(with_({"scheduling": {"queue": "team-a", "topology": {"level": "example.com/rack", "mode": mode}}}))[
        "PyTorchJob"]
    assert worker(job)["template"]["metadata"]["annotations"] == {annotation: "example.com/rack"}
    assert "annotations" not in worker(objects(with_({"scheduling": {"queue": "team-a"}}))["PyTorchJob"])[
        "template"]["metadata"]


def test_a_queued_elastic_run_is_created_at_min_nodes_for_kueue():
    queued = with_({"scheduling": {"queue": "team-a"}})  # nodes 2, minNodes 1
    assert worker(objects(queued)["PyTorchJob"])["replicas"] == 1
    assert worker(objects(BASE)["PyTorchJob"])["replicas"] == 2
    assert worker(objects(queued, Observed(nodes=1))["PyTorchJob"])["replicas"] == 1


def test_credentials_only_by_reference():
    objs = objects(BASE)
    env = worker(objs["PyTorchJob"])["template"]["spec"]["containers"][0]["env"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {"AWS_ACCESS_KEY_ID": {"name": "s3", "key": "AWS_ACCESS_KEY_ID"},
                    "AWS_SECRET_ACCESS_KEY": {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert {"name": "AWS_ENDPOINT_URL", "value": "http://s3:9000"} in env
    text = yaml.safe_dump(list(objs.values()))
    assert "secretKeyRef" in text and "value: s3\n" not in text


def test_tolerations_affinity_and_node_selector_pass_through():
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
    raw = with_({"resources.tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                            "effect": "NoSchedule"}],
                 "resources.affinity": affinity, "resources.nodeSelector": {"pool": "h200"},
                 "resources.cpu": "32", "resources.memory": "512Gi"})
    pod = worker(objects(raw)["PyTorchJob"])["template"]["spec"]
    assert pod["affinity"] == affinity
    assert pod["nodeSelector"] == {"pool": "h200", "nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"][0] == {"effect": "NoSchedule", "key": "dedicated", "operator": "Equal", "value": "ml"}
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "32", "memory": "512Gi",
                                                          "ephemeral-storage": "50Gi"}


def test_cpu_run_has_no_gpu_request_and_one_process_per_node():
    raw = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "cpu"}, "spec": {}}
    job = objects(raw)["PyTorchJob"]
    pod = worker(job)["template"]["spec"]
    assert job["spec"]["nprocPerNode"] == "1"
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"] and "nodeSelector" not in pod


def test_configmap_holds_the_resolved_spec_with_every_default():
    cm = objects(BASE)["ConfigMap"]
    resolved = yaml.safe_load(cm["data"]["spec.yaml"])
    again = parse(resolved)  # the trainer reads exactly this
    s = again.spec
    assert s.image == "registry.test/trainer:1"
    assert (s.model.dim, s.model.heads, s.model.kv_heads, s.model.layers) == (2048, 32, 8, 16)
    assert s.resources.processes_per_node == 8
    assert (s.elastic.min_nodes, s.elastic.max_nodes) == (1, 4)
    assert s.training.lr == 3.0e-4 and s.checkpoint.keep == 3  # defaults written out
    # resolving twice changes nothing
    assert dump(resolve(again, OperatorConfig(image="other"))) == dump(again)


def test_owner_references_and_labels_on_every_object():
    objs = objects(BASE)
    assert set(objs) == {"ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "ConfigMap", "PyTorchJob"}
    for obj in objs.values():
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner == {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "name": "base", "uid": UID,
                         "controller": True, "blockOwnerDeletion": True}
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"]["kiln.dev/trainingspec"] == "base"


def test_trainer_may_only_touch_its_own_status():
    role = objects(BASE)["Role"]
    assert role["rules"] == [{"apiGroups": ["kiln.dev"], "resources": ["trainingspecs/status"],
                              "resourceNames": ["base"], "verbs": ["get", "patch"]}]


def test_plan_is_deterministic():
    assert plan(doc_of(BASE)).objects == plan(doc_of(BASE)).objects


def test_pytorchjob_round_trips_through_the_kubeflow_models():
    job = objects(BASE)["PyTorchJob"]

    class Response:
        data = __import__("json").dumps(job)

    model = ApiClient().deserialize(Response, "KubeflowOrgV1PyTorchJob")
    assert isinstance(model, k.KubeflowOrgV1PyTorchJob)
    assert model.spec.elastic_policy.max_replicas == 4
    assert model.spec.pytorch_replica_specs["Worker"].restart_policy == "ExitCode"


def test_change_the_running_job_cannot_absorb_is_refused():
    applied = yaml.safe_load(objects(BASE)["ConfigMap"]["data"]["spec.yaml"])
    grown = with_({"model": {"preset": "llama-8b"}, "parallelism.tensor": 4})
    result = plan(doc_of(grown), Observed(applied=applied, job_active=True))
    assert result.objects == []
    assert 'spec.model.preset ("llama-1b" → "llama-8b")' in result.refused
    assert "spec.parallelism.tensor (2 → 4)" in result.refused
    # the same change before the job runs, or after it finished, is simply applied
    assert plan(doc_of(grown), Observed(applied=applied, job_active=False)).refused is None
    # absorbable changes (node count, suspend) go through while running
    scaled = with_({"resources.nodes": 4, "suspend": True})
    assert plan(doc_of(scaled), Observed(applied=applied, job_active=True)).refused is None


def test_elastic_decision_sets_the_replicas():
    job = objects(BASE, Observed(nodes=4))["PyTorchJob"]
    assert worker(job)["replicas"] == 4


def test_cluster_rules_are_enforced_by_plan():
    # fine for `kiln run --nproc N` (its own world), not at the 2 x 8 processes the spec names
    with pytest.raises(KilnError, match="spec.training.globalBatchSize"):
        plan(doc_of(with_({"training.globalBatchSize": 20})))


def test_s3_without_a_secret_gives_the_pods_no_keys_and_without_an_endpoint_no_endpoint():
    job = objects(with_({"checkpoint": {"uri": "s3://ckpt/x/"}}))["PyTorchJob"]
    env = {e["name"] for e in worker(job)["template"]["spec"]["containers"][0].get("env") or []}
    assert not env & {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"}, env


def test_render_cli_prints_applyable_yaml(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert main(["render", str(path), "-n", "team", "--image", "img:2"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "ConfigMap", "PyTorchJob"]
    assert all(d["metadata"]["namespace"] == "team" for d in docs)
    assert docs[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"] == "img:2"


def pod_of(raw: dict, config: OperatorConfig | None = None) -> dict:
    return worker(objects(raw, config=config)["PyTorchJob"])["template"]["spec"]


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}


def test_dev_shm_is_memory_sized_by_the_memory_limit_and_holds_the_restart_copy():
    pod = pod_of(with_({"resources.memory": "200Gi"}))
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "200Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    assert env_of(pod)["KILN_SHM_DIR"] == "/dev/shm/kiln"  # checkpoints go to a store (s3://)
    # no memory in the spec: the operator's default memory limit bounds it, never the node's whole memory
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}} in pod_of(BASE)["volumes"]
    small = OperatorConfig(image="x", default_memory="2Gi", default_cpu="500m")
    assert pod_of(BASE, small)["containers"][0]["resources"]["requests"]["cpu"] == "500m"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod_of(BASE, small)["volumes"]


def test_no_memory_copy_when_checkpoints_stay_on_the_pods_scratch_disk():
    pod = pod_of(with_({"checkpoint": None}))
    assert env_of(pod).get("KILN_SHM_DIR") is None
    assert "KILN_SHM_DIR" in env_of(pod_of(with_({"checkpoint": {"uri": "file:///mnt/shared/ckpt/"}})))


def test_grace_period_covers_a_final_save_and_torchrun_waits_for_it():
    pod = pod_of(BASE, OperatorConfig(image="x", termination_grace_seconds=300))
    assert pod["terminationGracePeriodSeconds"] == 300
    # torchrun forwards SIGTERM, then SIGKILLs the ranks after PET_SHUTDOWN_TIMEOUT: inside the grace period
    assert env_of(pod)["PET_SHUTDOWN_TIMEOUT"] == "290"
    assert int(env_of(pod_of(BASE))["PET_SHUTDOWN_TIMEOUT"]) < pod_of(BASE)["terminationGracePeriodSeconds"]


def test_torchrun_restarts_rendezvous_on_a_fresh_store():
    # In-place restarts (elasticPolicy.maxRestarts) on torchrun's shared store re-read the dead generation's
    # gloo addresses; tests/bench/bench_faults.py measures the difference. The pod opts out.
    assert env_of(pod_of(BASE))["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_trainer_pod_meets_pod_security_restricted():
    """Non-root, no privilege escalation, no capabilities, RuntimeDefault seccomp, a read-only root, and
    every path torch, Triton and kiln write on an emptyDir (tests/e2e runs it under `restricted` for real)."""
    pod = pod_of(BASE)
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    (c,) = pod["containers"]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "readOnlyRootFilesystem": True}
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert {v["name"] for v in pod["volumes"]} >= {"tmp", "scratch", "dshm"}
    env = env_of(pod)
    for var in ("TMPDIR", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KILN_DATA_CACHE"):
        assert any(env[var] == m or env[var].startswith(m + "/") for m in writable), (var, env[var], writable)
    output = c["command"][c["command"].index("--output") + 1]
    assert any(output.startswith(m + "/") for m in writable)


def test_trainer_pods_serve_metrics_on_the_operators_port():
    pod = pod_of(BASE)
    (c,) = pod["containers"]
    assert env_of(pod)["KILN_METRICS_PORT"] == "9400"
    assert {"name": "metrics", "containerPort": 9400} in c["ports"]
    off = pod_of(BASE, OperatorConfig(image="x", trainer_metrics_port=0))
    assert "KILN_METRICS_PORT" not in env_of(off)
    assert [p["name"] for p in off["containers"][0]["ports"]] == ["c10d"]


def test_a_model_from_a_folder_renders_with_the_dimensions_left_to_the_trainer(tmp_path):
    """model.from: the dimensions live in the folder's config.json, which only the pods read; the plan
    neither guesses them nor fails (kiln render printed a traceback here)."""
    raw = with_({"model": {"from": "s3://models/llama-3.2-1b/", "seqLen": 256}, "parallelism.tensor": 1})
    cm = objects(raw)["ConfigMap"]
    model = yaml.safe_load(cm["data"]["spec.yaml"])["spec"]["model"]
    assert model["from"] == "s3://models/llama-3.2-1b/" and model["seqLen"] == 256
    assert "dim" not in model and "layers" not in model
    sample = tmp_path / "s.yaml"
    sample.write_text(yaml.safe_dump(raw))
    assert main(["render", str(sample)]) == 0


def test_only_the_runs_own_pods_reach_its_pods_and_the_monitoring_namespace_the_metrics_port():
    policy = objects(BASE)["NetworkPolicy"]
    run = BASE["metadata"]["name"]
    mine = {"matchLabels": {"kiln.dev/trainingspec": run}}
    assert policy["metadata"]["name"] == f"{run}-trainer" and policy["spec"]["podSelector"] == mine
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress (S3, the apiserver) is left alone
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}  # the label the apiserver sets
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": mine}]},
        {"from": [{"namespaceSelector": monitoring}],
         "ports": [{"protocol": "TCP", "port": OperatorConfig().trainer_metrics_port}]}]
    # another monitoring namespace, or none: then nothing outside the run reaches the metrics port
    config = OperatorConfig.from_env({"KILN_MONITORING_NAMESPACE": "prometheus"})
    other = plan(parse(BASE), None, config).objects
    (np,) = [o for o in other if o["kind"] == "NetworkPolicy"]
    assert np["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "prometheus"}
    closed = plan(parse(BASE), None, OperatorConfig.from_env({"KILN_MONITORING_NAMESPACE": ""})).objects
    (np,) = [o for o in closed if o["kind"] == "NetworkPolicy"]
    assert np["spec"]["ingress"] == [{"from": [{"podSelector": mine}]}]
    # the pods it selects are the job's pods
    labels = objects(BASE)["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]
    assert labels["kiln.dev/trainingspec"] == run
