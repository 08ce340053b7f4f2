"""spec.pod settings and admin policies the pod tests share (tests/unit/test_control_pods.py,
tests/integration/test_operator_pods.py)."""

from __future__ import annotations

from kiln.control.policy import AdminPolicy

# what a site with RDMA nodes and a shared dataset folder allows (the chart documents these values)
OPEN = AdminPolicy(allowed_host_path_prefixes=("/mnt/datasets",), allowed_capabilities=("IPC_LOCK",),
                   allow_host_network=True, allow_host_ipc=True, allowed_extra_resources=("rdma/", "hugepages-2Mi",
                                                                                          "vpc.amazonaws.com/efa"))
CLOSED = AdminPolicy()  # the default: none of it

EVERYTHING = {
    "env": [{"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "WANDB_PROJECT", "valueFrom": {"configMapKeyRef": {"name": "site", "key": "project",
                                                                        "optional": True}}}],
    "volumes": [{"name": "cache", "mountPath": "/cache", "persistentVolumeClaim": {"claimName": "hf-cache"}},
                {"name": "site", "mountPath": "/etc/site", "readOnly": True, "configMap": {"name": "site"}},
                {"name": "creds", "mountPath": "/creds", "secret": {"secretName": "creds", "defaultMode": 0o400}},
                {"name": "fast", "mountPath": "/fast", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                {"name": "bucket", "mountPath": "/bucket", "csi": {"driver": "s3.csi.aws.com", "readOnly": True,
                                                                   "volumeAttributes": {"bucketName": "b"}}},
                {"name": "ds", "mountPath": "/data", "subPath": "c4", "hostPath": {"path": "/mnt/datasets/shared",
                                                                                   "type": "Directory"}}],
    "shmSize": "64Gi",
    "imagePullSecrets": [{"name": "regcred"}],
    "serviceAccountName": "team-irsa",
    "extraResources": [{"name": "rdma/ib", "quantity": "1"}, {"name": "hugepages-2Mi", "quantity": "5120Mi"}],
    "runtimeClassName": "nvidia",
    "capabilities": ["IPC_LOCK"],
    "hostNetwork": True,
    "hostIPC": True,
}
