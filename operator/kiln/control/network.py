"""spec.network → what each fabric needs in a trainer pod: NCCL's (or libfabric's) environment, the fabric's
device request, the capability RDMA needs. Pure. The admin policy (kiln.control.policy) judges the requests
and capabilities like the user's own; pod.env overrides any variable set here (kiln.control.pods).

Sources, per fabric (docs/pods.md "Network presets" lists the cluster prerequisites):
- NCCL's environment variables: https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
  (NCCL_IB_DISABLE: 1 keeps NCCL off the IB/RoCE verbs transport, on IP sockets; NCCL_SOCKET_IFNAME: the IP
  interfaces; NCCL_IB_GID_INDEX: the RoCE GID, picked by NCCL itself when unset, 2.21 and later).
- RDMA devices on Kubernetes (infiniband, roce): the NVIDIA Network Operator's RDMA shared device plugin,
  whose default resource is rdma/rdma_shared_device_a; its workloads add the IPC_LOCK capability to pin
  memory for RDMA (https://docs.nvidia.com/networking/display/cokan10/network+operator).
- EFA (https://docs.aws.amazon.com/eks/latest/userguide/node-efa.html, aws-ofi-nccl): the EFA device
  plugin's vpc.amazonaws.com/efa devices; libfabric's provider FI_PROVIDER=efa, which aws-ofi-nccl uses,
  and FI_EFA_USE_DEVICE_RDMA=1 for GPUDirect RDMA (p4d, p5). No capability: the device plugin hands the
  pod its uverbs devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.api.pod import NetworkSpec

DEFAULT_RESOURCE = {"infiniband": "rdma/rdma_shared_device_a", "roce": "rdma/rdma_shared_device_a",
                    "efa": "vpc.amazonaws.com/efa"}
RDMA_CAPABILITY = "IPC_LOCK"


@dataclass(frozen=True)
class Preset:
    env: dict[str, str] = field(default_factory=dict)
    resources: dict[str, str] = field(default_factory=dict)  # request = limit, per pod
    capabilities: tuple[str, ...] = ()


def preset(net: NetworkSpec | None) -> Preset:
    """What spec.network's fabric renders into every trainer pod (no network: nothing)."""
    if net is None:
        return Preset()
    env = {"NCCL_SOCKET_IFNAME": net.socket_interface} if net.socket_interface else {}
    if net.fabric == "tcp":
        return Preset({**env, "NCCL_IB_DISABLE": "1"})
    resources = {net.resource_name or DEFAULT_RESOURCE[net.fabric]: str(net.devices)}
    if net.fabric == "efa":
        return Preset({**env, "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}, resources)
    env["NCCL_IB_DISABLE"] = "0"  # the verbs transport, even where a site's image or nccl.conf turned it off
    if net.fabric == "roce" and net.gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = str(net.gid_index)
    return Preset(env, resources, (RDMA_CAPABILITY,))
