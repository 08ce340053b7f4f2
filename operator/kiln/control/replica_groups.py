"""Replica groups (elastic.faultTolerance replicaGroups, kiln.trainer.membership.replica_groups) as one layout
part (kiln.control.parts): the objects they add to a run, and what their status shows. Pure, but for
`observe_groups` (the groups' Workload reads) and `ReplicaGroups.status_inputs`, which calls it.

Objects: one PyTorchJob `<run>-g<i>` per group, nodes / groups Worker pods each at a fixed size (a group
restarts alone, the others step on), and torchft's lighthouse (a Deployment, a Service and a NetworkPolicy
`<run>-lighthouse`), which forms each step's quorum of the live groups.
Status: the run's job as the rest of kiln.control.status reads it (`combined_job`), status.replicaGroups
(`group_status`) and, under Kueue, each group's Workload (one each: Kueue admits each group alone) folded
into the run's place in the queue (`groups_state`: it runs while any group is admitted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.api import contract
from kiln.api.spec import GROUP_QUEUE_MESSAGE_MAX, TrainingSpec
from kiln.control import ft_secret, kueue
from kiln.control.config import OperatorConfig
from kiln.control.job_state import FINAL, job_condition, running_pods
from kiln.control.k8s import K8S_MODELS, SERIALIZER
from kiln.control.names import GROUP_LABEL, LIGHTHOUSE_LABEL, MANAGED_BY, RUN_LABEL, job_names, names
from kiln.control.observed import Observed
from kiln.control.pytorchjob import Shape, pytorchjob

k = K8S_MODELS

LIGHTHOUSE_PORT = 29510  # torchft_lighthouse's own default
# A group whose heartbeats stop this long is left out of the next quorum (the steps of the others pause at
# most about this long); 1 s as in `kiln run` would drop a group for one slow network round trip between
# nodes. A new quorum waits this long for groups still joining once one group is ready.
LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS = 2000
LIGHTHOUSE_JOIN_TIMEOUT_MS = 1000
LIGHTHOUSE_MEMORY = "128Mi"


def lighthouse_address(run: str) -> str:
    """KILN_FT_LIGHTHOUSE: the lighthouse's Service, in the run's namespace."""
    return f"http://{names(run)['lighthouse']}:{LIGHTHOUSE_PORT}"


def lighthouse(doc: TrainingSpec, config: OperatorConfig, metadata) -> list[dict]:
    """torchft's lighthouse for a run with replica groups: a NetworkPolicy (only the run's trainer pods reach
    it), a ClusterIP Service and a one-replica Deployment running torchft's lighthouse (`kiln-lighthouse`) from
    the trainer image.
    A Deployment, not a pod of a group's job: it must outlive any group's restart. It keeps no state a
    restart loses for good: the groups' next quorum requests form the quorum again."""
    run, s = doc.metadata.name, doc.spec
    name = names(run)["lighthouse"]
    selector = {LIGHTHOUSE_LABEL: run}
    container = k.V1Container(
        name="lighthouse",
        image=s.image,
        image_pull_policy=config.image_pull_policy,
        # kiln's entry to torchft's server: torchft's own console script imports torch first (kiln.cli.lighthouse)
        command=["kiln-lighthouse", "--min_replicas", "1",  # one live group keeps training
                 "--join_timeout_ms", str(LIGHTHOUSE_JOIN_TIMEOUT_MS),
                 "--heartbeat_timeout_ms", str(LIGHTHOUSE_HEARTBEAT_TIMEOUT_MS),
                 "--quorum_tick_ms", str(contract.FT_QUORUM_TICK_MS),
                 "--bind", f"[::]:{LIGHTHOUSE_PORT}",
                 "--secret_file", ft_secret.FILE],  # the port admits only holders of the run's secret
        env=[k.V1EnvVar(name="RUST_LOG", value="warn")],  # torchft logs every quorum at info
        volume_mounts=[ft_secret.mount()],
        ports=[k.V1ContainerPort(name="lighthouse", container_port=LIGHTHOUSE_PORT)],
        # a small Rust server: ~14 MB resident without torch (torchft's own script imported it: ~620 MB, and
        # 256Mi was OOMKilled on the rig's real node). Burstable, never BestEffort (the first evicted).
        resources=k.V1ResourceRequirements(requests={"cpu": "100m", "memory": LIGHTHOUSE_MEMORY},
                                           limits={"memory": LIGHTHOUSE_MEMORY}),
        readiness_probe=k.V1Probe(tcp_socket=k.V1TCPSocketAction(port=LIGHTHOUSE_PORT), period_seconds=5),
        security_context=k.V1SecurityContext(allow_privilege_escalation=False,
                                             capabilities=k.V1Capabilities(drop=["ALL"]),
                                             read_only_root_filesystem=True),
    )
    pod = k.V1PodSpec(
        containers=[container],
        automount_service_account_token=False,  # it talks to no apiserver
        volumes=[ft_secret.volume(run)],
        # the trainer image: pulled with the trainer pods' secrets
        image_pull_secrets=[k.V1LocalObjectReference(name=x.name) for x in s.pod.image_pull_secrets] or None,
        security_context=k.V1PodSecurityContext(run_as_non_root=True,
                                                seccomp_profile=k.V1SeccompProfile(type="RuntimeDefault")),
        # the pools the spec names (resources.nodeSelector, tolerations), where the groups' pods reach it; not
        # the GPU product selector nor the GPU toleration: it uses no GPU
        node_selector=dict(s.resources.node_selector) or None,
        tolerations=[k.V1Toleration(**t.model_dump(exclude_none=True)) for t in s.resources.tolerations] or None,
        priority_class_name=s.scheduling.priority_class_name,
    )
    template = {"metadata": {"labels": {**MANAGED_BY, **selector}}, "spec": SERIALIZER.sanitize_for_serialization(pod)}
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": metadata(name),
         "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": {"matchLabels": {RUN_LABEL: run}}}],
                               "ports": [{"protocol": "TCP", "port": LIGHTHOUSE_PORT}]}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(name),
         "spec": {"selector": selector, "ports": [{"name": "lighthouse", "port": LIGHTHOUSE_PORT,
                                                   "targetPort": LIGHTHOUSE_PORT, "protocol": "TCP"}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(name),
         "spec": {"replicas": 1, "selector": {"matchLabels": selector},
                  "strategy": {"type": "Recreate"},  # never two lighthouses, each with half the groups
                  "template": template}},
    ]


@dataclass(frozen=True)
class ReplicaGroups:
    """The layout part of a run with replica groups (kiln.control.parts.Layout)."""
    groups: int
    elastic_nodes = False  # each group's PyTorchJob is of a fixed size and restarts alone

    def job_names(self, run: str) -> list[str]:
        return job_names(run, self.groups)

    def read_names(self, run: str) -> list[str]:
        return [*self.job_names(run), run]  # and the run's single job, if any: switching faultTolerance under it is refused

    def objects(self, doc: TrainingSpec, observed: Observed, config: OperatorConfig, metadata) -> list[dict]:
        """The run's secret and the lighthouse before the jobs: a group's first quorum asks it."""
        run, size = doc.metadata.name, doc.spec.resources.nodes // self.groups
        # the names once: per job it was O(groups) each, O(groups²) a plan (16,000 groups: 45 s of CPU)
        return [ft_secret.secret(run, metadata), *lighthouse(doc, config, metadata),
                *(pytorchjob(doc, observed, config, metadata, name, Shape(
                    size, size, size,
                    # every group's rank 0 heartbeats to the lighthouse (kiln.trainer.membership.replica_groups)
                    env=((contract.FT_LIGHTHOUSE, lighthouse_address(run)), (contract.FT_GROUP, str(group)),
                         (contract.FT_SECRET_FILE, ft_secret.FILE)),
                    # the run's secret, as a file: only this run's groups and its lighthouse mount it
                    volumes=((ft_secret.volume(run), ft_secret.mount()),),
                    labels={GROUP_LABEL: str(group)}))
                  for group, name in enumerate(self.job_names(run)))]

    def view(self, run: str, found: list[dict]) -> tuple[dict | None, list[dict | None]]:
        """(the groups' jobs as one, kiln.control.status reads it; each group's job in group order, None: not there)."""
        by_name = {(j.get("metadata") or {}).get("name"): j for j in found}
        group_jobs = [by_name.get(n) for n in self.job_names(run)]
        return combined_job(group_jobs), group_jobs

    def status_inputs(self, kube, job: dict | None, group_jobs, old_status: dict | None) -> dict:
        """What kiln.control.status.derive takes of the groups: their jobs and, due a read, their Workloads."""
        return {"group_jobs": group_jobs, "group_queues": observe_groups(kube, group_jobs, old_status)}


@dataclass(frozen=True)
class Fold:
    """What the replica groups add to a run's status (kiln.control.status.derive)."""
    queue: kueue.QueueState | None = None  # the run's place in Kueue from its groups' (None: no queue) ...
    queue_read: bool = False  # ... when their Workloads were read this time
    fields: dict = field(default_factory=dict)  # {"replicaGroups": [...]}, none without groups
    events: tuple[tuple[str, str, str], ...] = ()  # (type, reason, message)


def fold(group_jobs: list[dict | None] | None, group_queues: list[kueue.QueueState | None] | None,
         pods: list[dict], old: dict) -> Fold:
    """The groups' part of the status: their place in Kueue, status.replicaGroups and the Events of a group
    lost or back (nothing for a run without groups: group_jobs None)."""
    if group_jobs is None:
        return Fold()
    queue = None
    if group_queues is not None:
        queue = groups_state(group_queues, [((j or {}).get("metadata") or {}).get("name") or f"group {i}"
                                            for i, j in enumerate(group_jobs)], old.get("queue"))
    groups = group_status(group_jobs, pods, old.get("replicaGroups"), group_queues)
    before = {g.get("group"): g.get("phase") for g in old.get("replicaGroups") or []}
    events = []
    for g in groups:
        was = before.get(g["group"])
        if was == "Running" and g["phase"] in ("Restarting", "Pending"):
            events.append(("Warning", "ReplicaGroupLost",
                           f"replica group {g['group']} ({g['job']}): {g['pods']} pod(s) running; "
                           f"it restarts alone, the other groups keep training"))
        elif was in ("Restarting", "Pending") and g["phase"] == "Running" and g["restarts"]:
            events.append(("Normal", "ReplicaGroupBack", f"replica group {g['group']} ({g['job']}) "
                           f"runs again (restart {g['restarts']}); it heals from a live group"))
    return Fold(queue, group_queues is not None, {"replicaGroups": groups}, tuple(events))


# With replica groups, the run is in the state of its liveliest group: one group running is a running run
LIVELIEST = ("Running", "Restarting", "Suspended", "Created")


def combined_job(jobs: list[dict | None]) -> dict | None:
    """The run's replica-group PyTorchJobs (in group order, None: not there) as the one job the rest of this
    module reads: Running while any group runs (the others restart alone, see group_status), Succeeded or
    Failed once every group has ended (Succeeded if any did: its weights are the run's). Under Kueue it is held
    (suspended) only while every group's job is; each group's Workload is read on its own (observe_groups).
    Labels and uid are group 0's; it has no replica count, so no group's restart reads as Scaling."""
    present = [j for j in jobs if j]
    if not present:
        return None
    states = [job_condition(j) for j in present]
    # under Kueue each group is admitted alone: the run is held only while every group is, and the groups
    # Kueue admitted decide its state meanwhile (one admitted group starts the run)
    each_held = [kueue.held(j) for j in present]
    held = all(each_held)
    if len(present) == len(jobs) and all(state in FINAL for state in states):
        state = "Succeeded" if "Succeeded" in states else "Failed"
    else:
        free = states if held else [s for s, h in zip(states, each_held) if not h]
        state = next((s for s in LIVELIEST if s in free), None)
    source = next((j for j, s in zip(present, states) if s == state), present[0])
    conditions = [c for c in (source.get("status") or {}).get("conditions") or []
                  if c.get("type") == state and c.get("status") == "True"]
    meta = present[0].get("metadata") or {}
    return {"metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                         "labels": meta.get("labels") or {},
                         "resourceVersion": ",".join(str((j.get("metadata") or {}).get("resourceVersion")) for j in present)},
            "spec": {"runPolicy": {**((present[0].get("spec") or {}).get("runPolicy") or {}), "suspend": held}},
            "status": {"conditions": conditions[-1:]}}


GROUP_QUEUE_FIELDS = ("queued", "queueReason", "queueMessage", "admittedAt")  # status.replicaGroups[], Kueue's


def group_status(jobs: list[dict | None], pods: list[dict], old: list[dict] | None,
                 queues: list[kueue.QueueState | None] | None = None) -> list[dict]:
    """status.replicaGroups: each group's phase, running pods and restarts. A group is Restarting while its job
    is active and fewer of its pods run than it has workers (a pod lost, or restarted by the training-operator);
    each move from Running to Restarting or Pending counts one restart of that group. queues: each group's place
    in Kueue (observe_groups), None: as recorded before."""
    before = {g.get("group"): g for g in old or []}
    out = []
    for group, job in enumerate(jobs):
        was = before.get(group, {})
        mine = [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(GROUP_LABEL) == str(group)]
        workers = (((job or {}).get("spec") or {}).get("pytorchReplicaSpecs") or {}).get("Worker") or {}
        desired, running, state = int(workers.get("replicas") or 0), running_pods(mine), job_condition(job)
        if state in FINAL:
            phase = state
        elif job is None or kueue.held(job) or state == "Suspended":
            phase = "Pending"
        elif desired and running >= desired:
            phase = "Running"
        else:
            phase = "Restarting" if state in ("Running", "Restarting") or was.get("phase") == "Running" else "Pending"
        restarts = int(was.get("restarts") or 0)
        if was.get("phase") == "Running" and phase in ("Restarting", "Pending"):
            restarts += 1
        queued = group_fields(queues[group], was) if queues is not None else \
            {k: was[k] for k in GROUP_QUEUE_FIELDS if k in was}
        out.append({"group": group, "job": ((job or {}).get("metadata") or {}).get("name"), "phase": phase,
                    "pods": running, "restarts": restarts, **queued})
    return out


PARTLY_ADMITTED = "GroupsWaiting"  # condition Queued=False: the run trains, some of its groups still wait


def group_needs_read(job: dict | None, old_group: dict | None) -> bool:
    """Whether a status refresh should read this group's Workload: while Kueue holds its job, and until the
    group's admission is recorded. An admitted group costs no read (an eviction suspends its job again)."""
    if not kueue.queue_name(job):
        return False
    old = old_group or {}
    return kueue.held(job) or old.get("queued") is not False or not old.get("admittedAt")


def group_fields(state: kueue.QueueState | None, old_group: dict | None) -> dict:
    """A group's queue fields in status.replicaGroups[] (none for a job without a queue)."""
    if state is None:
        return {}
    out = {"queued": not state.admitted, "queueReason": state.reason,
           "queueMessage": state.message[:GROUP_QUEUE_MESSAGE_MAX]}
    # when Kueue last admitted it: kept while it waits again (evicted), as status.queue.admittedAt
    if at := state.admitted_at if state.admitted else (old_group or {}).get("admittedAt"):
        out["admittedAt"] = at
    return out


def recorded(job: dict | None, old_group: dict | None) -> kueue.QueueState | None:
    """A group's state as the status recorded it (its Workload not read this time: admitted and running)."""
    queue, old = kueue.queue_name(job), old_group or {}
    if queue is None or "queued" not in old:
        return None
    return kueue.QueueState(queue, not old["queued"], old.get("queueReason") or "", old.get("queueMessage") or "",
                      admitted_at=old.get("admittedAt"))


def groups_state(states: list[kueue.QueueState | None], jobs: list[str], old_queue: dict | None) -> kueue.QueueState | None:
    """The run's place in Kueue from its groups' (in group order; jobs: their PyTorchJobs' names): admitted
    once any group is (the run trains with fewer groups meanwhile), with the groups still waiting named; the
    queue fields (when, which ClusterQueue and flavors) are the lowest-numbered admitted group's. None: no queue."""
    known = [s for s in states if s is not None]
    if not known:
        return None
    queue = known[0].queue
    waiting = tuple(i for i, s in enumerate(states) if s is None or not s.admitted)
    admitted = [s for s in states if s is not None and s.admitted]
    if waiting:  # the condition names every waiting group, and the first one's reason (the rest: replicaGroups)
        head = states[waiting[0]]
        why = f"{head.reason}: {head.message}" if head else "its PyTorchJob is not made yet"
        names = ", ".join(str(i) for i in waiting)
        detail = f"group {waiting[0]} ({jobs[waiting[0]]}): {why}"
    if not admitted:
        return kueue.QueueState(queue, False, head.reason if head else "WaitingForKueue",
                          f"no replica group admitted yet: group(s) {names} of {len(states)} wait in LocalQueue "
                          f"{queue}; {detail}", waiting_groups=waiting)
    lead, old = admitted[0], old_queue or {}
    # its ClusterQueue, flavors and topology as read just now, or as status.queue recorded them at its last read
    fields = dict(admitted_at=lead.admitted_at, cluster_queue=lead.cluster_queue, flavors=lead.flavors,
                  topology_levels=lead.topology_levels, topology_domains=lead.topology_domains) \
        if lead.cluster_queue else \
        dict(admitted_at=lead.admitted_at, cluster_queue=old.get("clusterQueue"),
             flavors=tuple(old.get("flavors") or ()),
             topology_levels=tuple((old.get("topology") or {}).get("levels") or ()),
             topology_domains=tuple((old.get("topology") or {}).get("domains") or ()))
    if waiting:
        return kueue.QueueState(queue, True, PARTLY_ADMITTED,
                          f"replica group(s) {names} of {len(states)} wait in LocalQueue {queue}, the run trains "
                          f"with the {len(admitted)} admitted meanwhile; {detail}", waiting_groups=waiting, **fields)
    return kueue.QueueState(queue, True, "Admitted", f"every replica group admitted; group 0: {states[0].message}",
                      waiting_groups=(), **fields)


def observe_groups(kube, jobs: list[dict | None], old_status: dict | None) -> list[kueue.QueueState | None] | None:
    """Each replica group's place in Kueue (in group order) for kiln.control.status.derive: read for the
    groups due a read (group_needs_read), as recorded for the others. None: no group's is due."""
    old = {g.get("group"): g for g in (old_status or {}).get("replicaGroups") or []}
    due = [group_needs_read(job, old.get(i)) for i, job in enumerate(jobs)]
    if not any(due):
        return None
    return [kueue.queue_state(job, kueue.read_workload(kube, job)) if read else recorded(job, old.get(i))
            for i, (job, read) in enumerate(zip(jobs, due))]

