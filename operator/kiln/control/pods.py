"""spec.pod (and the network preset) → the trainer pod's parts, with the kubernetes client's models. Pure.

kiln.control.plan puts these beside kiln's own: env after kiln's (pod.env overrides a preset's value, never
one of kiln's, which the API refuses), volumes and mounts after kiln's four. `security_level` says which Pod
Security level the rendered pod needs: `restricted` unless the spec asks for what the admin policy allowed
and that level forbids (https://kubernetes.io/docs/concepts/security/pod-security-standards/).
"""

from __future__ import annotations

from kiln.api.contract import GPU_POD_ENV
from kiln.api.pod import PodSettings, Volume
from kiln.api.spec import TrainingSpecSpec
from kiln.control.k8s import K8S_MODELS as k
from kiln.control.network import Preset, preset

# Pod Security `baseline` allows adding these capabilities, `restricted` only NET_BIND_SERVICE.
BASELINE_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                   "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
LEVEL_LABEL = "pod-security.kubernetes.io/enforce"


def env(s: TrainingSpecSpec) -> list:
    """The defaults of GPU pods (the NCCL flight recorder's size) and the network preset's variables, each
    replaced by pod.env's of the same name, then pod.env's others."""
    own = {e.name for e in s.pod.env}
    defaults = {**(GPU_POD_ENV if s.resources.gpus_per_node else {}), **preset(s.network).env}
    out = [k.V1EnvVar(name=name, value=value) for name, value in defaults.items() if name not in own]
    for e in s.pod.env:
        source = None
        if e.value_from is not None:
            ref = e.value_from.secret_key_ref or e.value_from.config_map_key_ref
            selector = dict(name=ref.name, key=ref.key, optional=ref.optional)
            source = k.V1EnvVarSource(secret_key_ref=k.V1SecretKeySelector(**selector)) \
                if e.value_from.secret_key_ref else k.V1EnvVarSource(config_map_key_ref=k.V1ConfigMapKeySelector(**selector))
        out.append(k.V1EnvVar(name=e.name, value=e.value, value_from=source))
    return out


def _source(v: Volume) -> dict:
    if c := v.persistent_volume_claim:
        return {"persistent_volume_claim": k.V1PersistentVolumeClaimVolumeSource(claim_name=c.claim_name,
                                                                                 read_only=c.read_only)}
    if c := v.config_map:
        return {"config_map": k.V1ConfigMapVolumeSource(name=c.name, optional=c.optional, default_mode=c.default_mode)}
    if c := v.secret:
        return {"secret": k.V1SecretVolumeSource(secret_name=c.secret_name, optional=c.optional,
                                                 default_mode=c.default_mode)}
    if c := v.empty_dir:
        return {"empty_dir": k.V1EmptyDirVolumeSource(medium=c.medium, size_limit=c.size_limit)}
    if c := v.csi:
        secret = k.V1LocalObjectReference(name=c.node_publish_secret_ref.name) if c.node_publish_secret_ref else None
        return {"csi": k.V1CSIVolumeSource(driver=c.driver, read_only=c.read_only, fs_type=c.fs_type,
                                           volume_attributes=c.volume_attributes or None,
                                           node_publish_secret_ref=secret)}
    c = v.host_path
    return {"host_path": k.V1HostPathVolumeSource(path=c.path, type=c.type)}


def volumes(pod: PodSettings) -> tuple[list, list]:
    """(volumes, volume mounts) of pod.volumes."""
    return ([k.V1Volume(name=v.name, **_source(v)) for v in pod.volumes],
            [k.V1VolumeMount(name=v.name, mount_path=v.mount_path, read_only=v.read_only, sub_path=v.sub_path)
             for v in pod.volumes])


def capabilities(s: TrainingSpecSpec, net: Preset | None = None) -> list[str]:
    """Capabilities added to the container: pod.capabilities and the network preset's (every other dropped)."""
    net = net or preset(s.network)
    return sorted({*s.pod.capabilities, *net.capabilities})


def security_level(s: TrainingSpecSpec) -> tuple[str, list[str]]:
    """(the Pod Security level the pods need: restricted | baseline | privileged, what needs more than
    restricted). Everything kiln sets itself is restricted-compliant."""
    privileged, baseline = [], []
    if s.pod.host_network:
        privileged.append("pod.hostNetwork")
    if s.pod.host_ipc:
        privileged.append("pod.hostIPC")
    privileged += [f"hostPath volume {v.name}" for v in s.pod.volumes if v.host_path]
    for cap in capabilities(s):
        if cap == "NET_BIND_SERVICE":
            continue
        (baseline if cap in BASELINE_CAPABILITIES else privileged).append(f"capability {cap}")
    if privileged:
        return "privileged", privileged + baseline
    return ("baseline", baseline) if baseline else ("restricted", [])
