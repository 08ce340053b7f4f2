"""spec.pod and spec.network: the trainer pods' settings a site needs, with Kubernetes' own field names.

Each model mirrors the core/v1 object it becomes (EnvVar, Volume + VolumeMount, LocalObjectReference), cut to
the fields a training pod needs; kiln.control.plan renders them with the kubernetes client's models. What
only the cluster's admin may allow (hostPath, capabilities, host namespaces, extra devices, service
accounts) is the admin policy's (kiln.control.policy); what would break the run (kiln's own env names,
volumes and mounts) is refused here, offline and by the CRD's CEL alike.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from kiln.api.base import QUANTITY, ApiModel, exactly_one, one_of_cel, with_cel
from kiln.api.contract import POD_MOUNTS, POD_VOLUMES, RESERVED_ENV, RESERVED_ENV_PREFIXES

ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"  # Kubernetes' rule for env names
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# An extended resource (a device plugin's: rdma/ib, vpc.amazonaws.com/efa) or huge pages
EXTRA_RESOURCE = (r"^(([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*"
                  r"[A-Za-z0-9])?)|hugepages-(2Mi|1Gi))$")
# resources with a field of their own (resources.*), never through pod.extraResources
OWN_RESOURCES = ("cpu", "memory", "ephemeral-storage", "nvidia.com/gpu")
CAPABILITY = r"^[A-Z][A-Z_]*$"  # as Kubernetes writes them: IPC_LOCK, without CAP_


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


def _no_dotdot(path: str) -> bool:
    return "/../" not in path + "/"


NO_DOTDOT_CEL = "!(self.{f} + '/').contains('/../')"


class KeySelector(ApiModel):
    """One key of a Secret or ConfigMap in the run's namespace (core/v1 SecretKeySelector, ConfigMapKeySelector)."""

    name: str = Field(..., max_length=253, pattern=DNS_SUBDOMAIN, description="The Secret's or ConfigMap's name.")
    key: str = Field(..., min_length=1, max_length=253, description="The key whose value the variable takes.")
    optional: bool | None = Field(None, description="true: start without the variable when the key is missing.")


_ENV_SOURCES = ("secretKeyRef", "configMapKeyRef")


class EnvVarSource(ApiModel):
    """Where a variable's value comes from (core/v1 EnvVarSource): a Secret's or a ConfigMap's key."""

    model_config = with_cel((one_of_cel(_ENV_SOURCES), "valueFrom sets exactly one of secretKeyRef, configMapKeyRef"))
    secret_key_ref: KeySelector | None = Field(None, description="A key of a Secret (read by reference; its value "
                                                                 "never appears in any object kiln writes).")
    config_map_key_ref: KeySelector | None = Field(None, description="A key of a ConfigMap.")

    @model_validator(mode="after")
    def _one(self) -> "EnvVarSource":
        exactly_one(self, _ENV_SOURCES, "valueFrom")
        return self


class EnvVar(ApiModel):
    """One environment variable of the trainer container (core/v1 EnvVar)."""

    model_config = with_cel(("has(self.value) != has(self.valueFrom)", "an env entry sets value or valueFrom"))
    name: str = Field(..., min_length=1, max_length=256, pattern=ENV_NAME, description="The variable's name.")
    value: str | None = Field(None, max_length=32768, description="A plain value.")
    value_from: EnvVarSource | None = Field(None, description="A Secret's or ConfigMap's key.")

    @model_validator(mode="after")
    def _one(self) -> "EnvVar":
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"env {self.name}: an env entry sets value or valueFrom")
        return self


class PersistentVolumeClaimSource(ApiModel):
    claim_name: str = Field(..., max_length=253, pattern=DNS_SUBDOMAIN, description="A PVC in the run's namespace.")
    read_only: bool | None = Field(None, description="Mount the claim read-only.")


class ConfigMapSource(ApiModel):
    name: str = Field(..., max_length=253, pattern=DNS_SUBDOMAIN, description="A ConfigMap in the run's namespace.")
    optional: bool | None = Field(None, description="true: start without it when it is missing.")
    default_mode: int | None = Field(None, ge=0, le=0o777, description="File mode bits of its files (e.g. 0444).")


class SecretSource(ApiModel):
    secret_name: str = Field(..., max_length=253, pattern=DNS_SUBDOMAIN, description="A Secret in the run's namespace.")
    optional: bool | None = Field(None, description="true: start without it when it is missing.")
    default_mode: int | None = Field(None, ge=0, le=0o777, description="File mode bits of its files (e.g. 0400).")


class EmptyDirSource(ApiModel):
    medium: Literal["", "Memory"] | None = Field(None, description="'' (the node's disk) or Memory (tmpfs, counted "
                                                                   "against the memory limit).")
    size_limit: str | None = Field(None, max_length=32, pattern=QUANTITY, description="e.g. 100Gi.")


class ExtraResource(ApiModel):
    """One extended resource each pod requests (request = limit, as Kubernetes requires for them)."""

    model_config = with_cel((f"!({_cel_list(OWN_RESOURCES)}.exists(o, o == self.name))",
                             "cpu, memory, ephemeral-storage and GPUs are set in resources, not pod.extraResources"))
    name: str = Field(..., max_length=253, pattern=EXTRA_RESOURCE,
                      description="An extended resource (a domain and a name, e.g. rdma/ib, vpc.amazonaws.com/efa) "
                                  "or hugepages-2Mi / hugepages-1Gi.")
    quantity: str = Field(..., max_length=32, pattern=QUANTITY, description="How many (or how much), e.g. 1, 5120Mi.")

    @model_validator(mode="after")
    def _not_own(self) -> "ExtraResource":
        if self.name in OWN_RESOURCES:
            raise ValueError(f"pod.extraResources: {self.name} is set in resources (cpu, memory, ephemeralStorage, "
                             "gpusPerNode), not here")
        return self


class LocalObjectReference(ApiModel):
    """A named object in the run's namespace (core/v1 LocalObjectReference)."""

    name: str = Field(..., max_length=253, pattern=DNS_SUBDOMAIN, description="Its name.")


class CsiSource(ApiModel):
    """A CSI ephemeral inline volume (core/v1 CSIVolumeSource), e.g. a Secrets Store or a FUSE bucket driver."""

    driver: str = Field(..., max_length=63, pattern=DNS_SUBDOMAIN, description="The CSI driver's name.")
    read_only: bool | None = Field(None, description="Mount it read-only.")
    fs_type: str | None = Field(None, max_length=63, description="Filesystem type, e.g. ext4.")
    volume_attributes: dict[str, str] = Field(default_factory=dict, max_length=64,
                                              description="Driver-specific attributes.")
    node_publish_secret_ref: LocalObjectReference | None = Field(None, description="A Secret the driver reads.")


class HostPathSource(ApiModel):
    """A folder of the node (core/v1 HostPathVolumeSource): only under a prefix the admin policy allows."""

    model_config = with_cel((NO_DOTDOT_CEL.format(f="path"), "hostPath.path may not contain '..'"))
    path: str = Field(..., min_length=1, max_length=4096, pattern=r"^/", description="An absolute path on the node.")
    type: Literal["", "Directory", "DirectoryOrCreate", "File", "FileOrCreate"] | None = Field(
        None, description="What must be there (Kubernetes' hostPath types; sockets and devices are not offered).")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not _no_dotdot(v):
            raise ValueError("hostPath.path may not contain '..'")
        return v


_VOLUME_SOURCES = ("persistentVolumeClaim", "configMap", "secret", "emptyDir", "csi", "hostPath")


class Volume(ApiModel):
    """A volume mounted into the trainer container: core/v1 Volume (name and one source) and VolumeMount
    (mountPath, readOnly, subPath) in one entry."""

    model_config = with_cel(
        (one_of_cel(_VOLUME_SOURCES), "a volume sets exactly one of " + ", ".join(_VOLUME_SOURCES)),
        (f"!({_cel_list(POD_VOLUMES)}.exists(n, n == self.name))", "this volume name is kiln's own: " + ", ".join(POD_VOLUMES)),
        (f"!({_cel_list(POD_MOUNTS)}.exists(p, p == self.mountPath))", "this mountPath is kiln's own: " + ", ".join(POD_MOUNTS)),
        (NO_DOTDOT_CEL.format(f="mountPath"), "mountPath may not contain '..'"),
    )
    name: str = Field(..., max_length=63, pattern=DNS_LABEL, description="The volume's name in the pod.")
    mount_path: str = Field(..., min_length=2, max_length=1024, pattern=r"^/",
                            description="Where the container sees it (absolute).")
    read_only: bool | None = Field(None, description="Mount read-only.")
    sub_path: str | None = Field(None, max_length=1024, pattern=r"^[^/]",
                                 description="Mount this relative path of the volume instead of its root.")
    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(None, description="A PersistentVolumeClaim.")
    config_map: ConfigMapSource | None = Field(None, description="A ConfigMap's keys as files.")
    secret: SecretSource | None = Field(None, description="A Secret's keys as files.")
    empty_dir: EmptyDirSource | None = Field(None, description="An empty folder for the pod's life.")
    csi: CsiSource | None = Field(None, description="A CSI ephemeral volume.")
    host_path: HostPathSource | None = Field(None, description="A node folder (admin policy: allowed prefixes).")

    @model_validator(mode="after")
    def _rules(self) -> "Volume":
        exactly_one(self, _VOLUME_SOURCES, f"volume {self.name}")
        if self.name in POD_VOLUMES:
            raise ValueError(f"volume name {self.name!r} is kiln's own ({', '.join(POD_VOLUMES)}); choose another")
        if self.mount_path in POD_MOUNTS:
            raise ValueError(f"volume {self.name}: mountPath {self.mount_path} is kiln's own "
                             f"({', '.join(POD_MOUNTS)}); choose another")
        if not _no_dotdot(self.mount_path):
            raise ValueError(f"volume {self.name}: mountPath may not contain '..'")
        return self


def reserved_env(name: str) -> bool:
    """Whether kiln sets this variable itself (kiln.api.contract): a user's value would break the run."""
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES)


_RESERVED_ENV_CEL = (f"!has(self.env) || self.env.all(e, !({_cel_list(RESERVED_ENV)}.exists(n, n == e.name)) && "
                     f"!({_cel_list(RESERVED_ENV_PREFIXES)}.exists(p, e.name.startsWith(p))))")
RESERVED_ENV_MESSAGE = ("pod.env may not set a variable kiln sets itself (" + ", ".join(RESERVED_ENV) + ", or any "
                        + "*, ".join(RESERVED_ENV_PREFIXES) + "*): for keys use checkpoint.credentialsSecret, "
                        "checkpoint.endpoint and tracking.*.credentialsSecret")


class PodSettings(ApiModel):
    """The trainer pods' site settings. Everything here is passed to every worker pod of the run."""

    model_config = with_cel(
        (_RESERVED_ENV_CEL, RESERVED_ENV_MESSAGE),
        # every rule guards with has(): the apiserver evaluates them on the schema's default ({}) too
        ("!has(self.env) || self.env.all(a, self.env.exists_one(b, b.name == a.name))",
         "pod.env names each variable once"),
        ("!has(self.volumes) || self.volumes.all(a, self.volumes.exists_one(b, b.name == a.name))",
         "pod.volumes names each volume once"),
        ("!has(self.volumes) || self.volumes.all(a, self.volumes.exists_one(b, b.mountPath == a.mountPath))",
         "pod.volumes mounts one volume per mountPath"),
        ("!has(self.extraResources) || self.extraResources.all(a, self.extraResources.exists_one(b, b.name == a.name))",
         "pod.extraResources names each resource once"),
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128,
        description="Environment variables of the trainer container, plain or from a Secret's or ConfigMap's key; "
        "they override a network preset's. Names kiln sets itself are refused: " + ", ".join(RESERVED_ENV) + ", and "
        "every name starting " + ", ".join(RESERVED_ENV_PREFIXES) + ".")
    volumes: list[Volume] = Field(default_factory=list, max_length=32, description="Volumes mounted into the trainer.")
    shm_size: str | None = Field(
        None, max_length=32, pattern=QUANTITY,
        description="Size of /dev/shm (tmpfs, counted against the memory limit). Default: the memory limit.")
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Secrets to pull the image with, e.g. [{name: regcred}].")
    service_account_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN,
        description="The pods' ServiceAccount (for IRSA or workload identity annotations); kiln also grants it the "
        "run's status patch. Default: the run's own <name>-trainer. Admin policy: allowed names.")
    # a list of {name, quantity}, not a core/v1 ResourceList map: a map's keys have no length bound in a CRD,
    # so the apiserver's CEL cost estimate could not bound a check of them
    extra_resources: list[ExtraResource] = Field(
        default_factory=list, max_length=16,
        description="Extra per-pod requests (= limits) of extended resources, e.g. [{name: rdma/ib, quantity: '1'}] "
        "or [{name: vpc.amazonaws.com/efa, quantity: '32'}, {name: hugepages-2Mi, quantity: 5120Mi}]. Admin "
        "policy: allowed names.")
    runtime_class_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN,
                                           description="The pods' RuntimeClass, e.g. nvidia.")
    capabilities: list[Annotated[str, Field(max_length=64, pattern=CAPABILITY)]] = Field(
        default_factory=list, max_length=16,
        description="Linux capabilities added to the container (every other one stays dropped), e.g. IPC_LOCK for "
        "RDMA. Admin policy: an allow-list, empty by default.")
    host_network: bool = Field(False, description="Use the node's network namespace (admin policy: allowHostNetwork).")
    host_ipc: bool = Field(False, alias="hostIPC", description="Use the node's IPC namespace (admin policy: allowHostIPC).")

    @model_validator(mode="after")
    def _rules(self) -> "PodSettings":
        import re

        problems = []
        if reserved := [e.name for e in self.env if reserved_env(e.name)]:
            problems.append(f"pod.env may not set {', '.join(reserved)}: kiln sets it itself, and another value "
                            "would break the run (kiln.api.contract.RESERVED_ENV; for the store's and the "
                            "trackers' keys use checkpoint.credentialsSecret, checkpoint.endpoint and "
                            "tracking.*.credentialsSecret)")
        for what, values in (("pod.env names each variable once", [e.name for e in self.env]),
                             ("pod.extraResources names each resource once", [r.name for r in self.extra_resources]),
                             ("pod.volumes names each volume once", [v.name for v in self.volumes]),
                             ("pod.volumes mounts one volume per mountPath", [v.mount_path for v in self.volumes])):
            if twice := sorted({x for x in values if values.count(x) > 1}):
                problems.append(f"{what} (got {', '.join(twice)} twice)")
        if problems:
            raise ValueError("; ".join(problems))
        return self


Fabric = Literal["tcp", "infiniband", "roce", "efa"]


class NetworkSpec(ApiModel):
    """The fabric NCCL uses between nodes; kiln.control.network renders each preset's environment and device
    requests (docs/pods.md "Network presets"). pod.env overrides any variable a preset sets."""

    fabric: Fabric = Field(..., description="tcp | infiniband | roce | efa.")
    devices: int = Field(
        1, ge=1, le=64,
        description="infiniband, roce, efa: the fabric's devices each pod requests (efa: the node's EFA count, e.g. "
        "32 on p5.48xlarge, 4 on p4d.24xlarge).")
    resource_name: str | None = Field(
        None, max_length=253, pattern=EXTRA_RESOURCE,
        description="The device plugin's resource name for the fabric's devices. Default: rdma/rdma_shared_device_a "
        "(infiniband, roce: the NVIDIA Network Operator's RDMA shared device plugin), vpc.amazonaws.com/efa (efa).")
    socket_interface: str | None = Field(
        None, max_length=256, pattern=r"^[\^=]?[=]?[A-Za-z0-9_.,:\-]+$",
        description="NCCL_SOCKET_IFNAME: the IP interfaces NCCL bootstraps over (and, with tcp, sends over), "
        "e.g. eth0 or ^lo,docker.")
    gid_index: int | None = Field(
        None, ge=0, le=255, description="roce: NCCL_IB_GID_INDEX, the RoCE v2 GID; unset: NCCL picks it (2.21+).")
