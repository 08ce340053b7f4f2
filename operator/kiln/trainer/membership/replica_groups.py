"""Per-step fault tolerance across replica groups (`elastic.faultTolerance: {mode: replicaGroups}`), on torchft.

The data-parallel dimension is split into N replica groups. Each group is its own torchrun job with its own
world: FSDP/TP/PP inside it exactly as without fault tolerance (the group's layout is kiln.api.layout's
`plan` of `replica_group_spec`: globalBatchSize / N sequences per step). Across groups, torchft does the rest:

- the lighthouse (address in KILN_FT_LIGHTHOUSE) forms a quorum of the live groups every step; each group's
  rank 0 runs a torchft ManagerServer that heartbeats to it;
- after backward, each rank averages its gradient shard with the same shard of every live group through
  torchft's fault-tolerant process group (gloo on CPU, NCCL on GPU; reconfigured when the quorum changes), so
  the clipping, the guards and the optimizer see the same gradient in every group;
- `Manager.should_commit` is the step's vote: when a collective failed (a peer died mid-step) no group of
  this quorum steps its optimizer and the step is redone with the next quorum;
- a group that joins behind the others (restarted after a fault, or fallen behind) receives the weights,
  optimizer state and trainer state (step, data cursor, RNG, guard state, goodput counters) of a live peer
  over the groups' process group (torchft's PGTransport, in place) inside the quorum, and reads no checkpoint;
- when nobody has stepped yet (a fresh start or a whole-job restart) every group restores the newest commit,
  as without fault tolerance; only the group at replica rank 0 of the current quorum writes commits.

The data cursor (samples consumed by the whole job) advances only on a committed step, by the samples of the
groups that took part: participant r of k reads samples [cursor + r·b, cursor + (r+1)·b) of the seeded order
(b = globalBatchSize / N), and the cursor moves by k·b. No sample is skipped or read twice across a
membership change; while fewer than N groups are live, a step averages k·b sequences instead of N·b (a smaller
batch at the same learning rate), and the run still takes training.steps optimizer steps.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kiln.api import contract
from kiln.api.layout import replica_groups
from kiln.errors import KilnError
from kiln.trainer.membership.auth import Tunnel, host_port, secret_from_env
from kiln.trainer.membership.hang_watch import HangWatch, floor_s, leave
from kiln.trainer.membership.heal_guard import GuardedPG
from kiln.trainer.hooks import MembershipChange
from kiln.trainer.state import RunState, local

TIMEOUT_ENV = "KILN_FT_TIMEOUT_SECONDS"  # collectives, commit votes and peer transfers (default 60)
# At a fresh start (or a whole-job restart) wait this long for every group before stepping with fewer: a group
# that comes later still joins, but heals from a peer and the first steps average a smaller batch.
START_WAIT_ENV = "KILN_FT_START_WAIT_SECONDS"  # default 120
# The lighthouse may die and come back (its Deployment restarts it): each group's torchft manager then retries
# the step's quorum, reconnecting meanwhile, for up to this long before the trainer fails. Without retries the
# manager dropped the failed request and the quorum hung until its timeout, then every group failed at once.
LIGHTHOUSE_WAIT_ENV = "KILN_FT_LIGHTHOUSE_WAIT_SECONDS"  # default 300
STACKS_WAIT_S = 10.0  # a hung group's ranks write their stacks (kiln.trainer.observe.hang_report) for this long at most
QUORUM_RETRY_S = 0.5  # torchft waits quorum_timeout / (retries + 1) between tries; this sets the retries


def rank0_decides(value: bool) -> bool:
    """Rank 0's `value` on every rank of the group (its own world; a no-op for one rank). Every rank of a group
    must ask for the same quorums (torchft's manager server waits for all of them), so a decision taken on a
    rank's own clock must be one decision: rank 1 asking once more than rank 0 hangs until the quorum times out."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


# optimizer settings the loop sets before every step (kiln.trainer.run: set_lr), whatever a heal brings
_SET_EACH_STEP = (".lr",)


class ReplicaGroups:
    """One replica group's side of the job: its torchft Manager, and the membership strategy the run calls
    (kiln.trainer.membership.strategy.Membership; the other one is Solo).

    `state` is the run's (kiln.trainer.state): what a healing peer receives and loads, all of it;
    `on_membership_change` is called with each new quorum after the first (kiln.trainer.hooks)."""

    def __init__(self, spec, *, rank: int, world: int, device: torch.device, state: RunState,
                 on_membership_change: Callable[[MembershipChange], None]):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        lighthouse = os.environ.get(contract.FT_LIGHTHOUSE)
        if not lighthouse:
            raise KilnError(f"elastic.faultTolerance.mode replicaGroups needs the lighthouse address in "
                            f"{contract.FT_LIGHTHOUSE} (e.g. http://kiln-lighthouse:29510)")
        self._tunnel = None
        secret = secret_from_env(contract.FT_SECRET, contract.FT_SECRET_FILE)
        if secret is not None:  # the lighthouse admits only holders of the run's secret: reach it through a tunnel
            try:
                self._tunnel = Tunnel("client", secret, host_port(lighthouse))
            except ValueError as err:
                raise KilnError(f"replica groups: {err}") from None
            lighthouse = self._tunnel.address()
        self.groups = replica_groups(spec)
        self.group = int(os.environ.get(contract.FT_GROUP, "0"))
        if not 0 <= self.group < self.groups:
            raise KilnError(f"{contract.FT_GROUP}={self.group}: replica groups are numbered 0..{self.groups - 1} "
                            f"(elastic.faultTolerance.groups)")
        self.per_group = self.rows_per_step = spec.training.global_batch_size // self.groups
        self.rank, self.device = rank, device
        self.state = state
        self.on_membership_change = on_membership_change
        self.watch = HangWatch(floor=floor_s())  # this group's loop; torchft's waits below are paused in it
        timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "60")))
        # a quorum waits for the lighthouse (its restart) as well as for the other groups' steps
        quorum_timeout = max(timeout, timedelta(seconds=float(os.environ.get(LIGHTHOUSE_WAIT_ENV, "300"))))
        pg = ProcessGroupGloo(timeout=timeout) if device.type == "cpu" else ProcessGroupNCCL(timeout=timeout)
        # a heal travels over the same process group, received straight into this group's own weight and
        # optimizer tensors: torchft's HTTP transport pickled every tensor, and the load copied them again
        # what a peer declares (lengths, sizes, the pickled description) is checked before torchft acts on it
        transport = PGTransport(GuardedPG(pg, state), timeout=timeout, device=device, state_dict=self._receive_into)
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, checkpoint_transport=transport,
            min_replica_size=1,  # one live group keeps training
            use_async_quorum=False,  # heal before the forward pass: the joining group takes part in this step
            init_sync=False,  # every group initialises the same weights from training.seed
            replica_id=f"kiln_group_{self.group}", lighthouse_addr=lighthouse, rank=rank, world_size=world,
            timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=timeout,
            quorum_retries=int(quorum_timeout.total_seconds() / QUORUM_RETRY_S),
        )
        self.manager.register_state_dict_fn("kiln", self._load, state.state_dict)
        self._healed: dict | None = None
        self._joined = False
        self.replica_rank, self.participants, self.quorum_id = 0, 1, -1
        self.heals = self.quorum_changes = self.redone = 0
        self.restore_source = "none"  # how this process got its state: peer | checkpoint | none (fresh)
        self.quorum_s = self.load_s = 0.0  # the last quorum's time (a heal included), the last heal's load

    # ---- state a healing peer receives --------------------------------------------------------------------

    def _receive_into(self) -> dict:
        """Where a heal lands: the tensors of the sender's state (RunState.state_dict under torchft's own keys)
        that this group already holds, by path (get_state_dict makes a fresh optimizer's state); the trainer
        state is new."""
        return {"user": {"kiln": self.state.model.local_tensors()}}

    def _load(self, sent: dict) -> None:
        """A peer's whole state, into the run's: tensors received in place are loaded already."""
        t0 = time.monotonic()
        self.state.load_state_dict(sent, unless=_SET_EACH_STEP)
        self._healed = sent["trainer"]
        self.load_s = time.monotonic() - t0

    # ---- the loop's calls ---------------------------------------------------------------------------------

    def _quorum(self) -> dict | None:
        self._healed = None
        t0 = time.monotonic()
        with self.watch.waiting():
            self.manager.start_quorum()  # synchronous: a heal is applied before it returns
        self.quorum_s = time.monotonic() - t0
        rank, k = self.manager.participating_rank(), self.manager.num_participants()
        quorum_id, first = self.manager._quorum_id, self.quorum_id == -1
        changed = quorum_id != self.quorum_id
        if changed and self.rank == 0:
            print(f"kiln: ft: group {self.group}: quorum {quorum_id}: {k} of {self.groups} group(s) live, "
                  f"this group is replica rank {rank}", flush=True)
        self.quorum_id, self.replica_rank, self.participants = quorum_id, rank if rank is not None else 0, k
        if changed and not first:  # the one place a membership change is seen
            self.quorum_changes += 1
            self.on_membership_change(MembershipChange(step=self.manager.current_step(), quorum_id=quorum_id,
                                                       participants=k, groups=self.groups,
                                                       replica_rank=self.replica_rank))
        if self._healed is not None:
            self.heals += 1
            self.restore_source = "peer"
            if self.rank == 0:
                print(f"kiln: ft: group {self.group} healed from a live peer at step {self._healed['step']} "
                      f"(no checkpoint read)", flush=True)
        return self._healed

    waits_for_peers = True  # from its join on, the live groups wait for this one

    def join(self) -> bool:
        """The first quorum, before any restore: True when this group healed from a live peer (the run's whole
        state is loaded already), else False: nobody has stepped, restore the newest commit (every group does,
        so all start from the same step)."""
        self._joined = True
        healed = self._quorum()
        deadline = time.monotonic() + float(os.environ.get(START_WAIT_ENV, "120"))
        while healed is None and self.manager.current_step() == 0 and self.participants < self.groups \
                and rank0_decides(time.monotonic() < deadline):  # nobody has stepped: wait for the groups starting
            time.sleep(0.05)  # a new quorum request, not a wait for an event: the lighthouse answers at once
            healed = self._quorum()
        return healed is not None

    def restored(self, step: int, from_checkpoint: bool) -> None:
        """After the restore that join() left to the caller: the Manager counts steps from there."""
        if from_checkpoint:
            self.restore_source = "checkpoint"
        self._sync_step(step)

    def _sync_step(self, step: int) -> None:
        if self.manager.current_step() != step:  # a restore from a commit (start, guard rollback) moved it
            self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def begin_step(self, step: int) -> bool:
        """Before each step: this step's quorum (the first one is join's). True when this group healed (the
        run's whole state is a peer's now: the loop resumes from it)."""
        self._sync_step(step)
        if self._joined:
            self._joined = False
            return False
        return self._quorum() is not None

    def next_batch(self, loader, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, ...]:
        """This rank's rows of this group's share of the step (inputs, targets[, doc_ids]): its slot is its
        replica rank in the quorum."""
        per_rank = self.per_group // dp_size
        first = loader.samples_seen + self.replica_rank * self.per_group + dp_rank * per_rank
        return loader.rows(first, per_rank)

    @property
    def batch_share(self) -> float:
        """The fraction of the global batch this step averages (the guards judge its loss by it)."""
        return self.participants / self.groups

    def step_tokens(self, seq_len: int) -> int:
        return self.participants * self.per_group * seq_len

    def _allreduce_mean(self, flat: torch.Tensor) -> None:
        try:
            with self.watch.waiting():
                self.manager.allreduce(flat).wait()
        except Exception as err:  # noqa: BLE001  the vote below turns it into a redone step
            self.manager.report_error(err)

    def reduce_gradients(self, model_parts) -> None:
        """Average every local gradient (shard) with the same shard of every live group, in one collective."""
        grads = [p.grad for part in model_parts for p in part.parameters() if p.grad is not None]
        shards = [g._local_tensor if isinstance(g, DTensor) else g for g in grads]
        if not shards:
            return
        flat = torch.cat([t.reshape(-1).float() for t in shards])
        self._allreduce_mean(flat)
        offset = 0
        with torch.no_grad():
            for t in shards:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n

    def reduce_loss(self, loss: float) -> float:
        value = torch.tensor([loss], dtype=torch.float64 if self.device.type == "cpu" else torch.float32,
                             device=self.device)
        self._allreduce_mean(value)
        return float(value)

    def commit(self, loader) -> bool:
        """The step's vote (every group of the quorum agrees): True → step the optimizer, and the data cursor
        moves past the samples every participant read; False → the step is redone with the next quorum."""
        with self.watch.waiting():
            committed = self.manager.should_commit()
        if committed:
            loader.samples_seen += self.participants * self.per_group
            return True
        self.redone += 1
        self.watch.stepped()  # a redone step: the loop moved
        return False

    def weights_digest(self) -> str:
        """sha256 of each rank's parameter shards (bit-exact), in the group's rank order, comma-separated (one
        digest for a one-rank group): equal across groups rank by rank. Every rank of the group calls it."""
        digest = hashlib.sha256()
        for part in self.state.model.parts:
            for name, p in part.named_parameters():
                mine = local(p).contiguous().cpu()
                digest.update(name.encode())
                digest.update(mine.reshape(-1).view(torch.uint8).numpy().tobytes() if mine.numel() else b"")
        mine = digest.hexdigest()[:16]
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        every: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)  # the group's own world (torchft's process group spans the groups)
        return ",".join(every)

    @property
    def writes_checkpoints(self) -> bool:
        return self.replica_rank == 0

    def metrics(self) -> dict:
        return {"ft_group": self.group, "ft_groups": self.groups, "ft_replica_rank": self.replica_rank,
                "ft_participants": self.participants,
                "ft_quorum_id": self.quorum_id, "ft_quorum_changes": self.quorum_changes, "ft_heals": self.heals,
                "ft_redone_steps": self.redone, "ft_restore": self.restore_source,
                "ft_quorum_s": self.quorum_s, "ft_heal_load_s": self.load_s}

    def final_metrics(self) -> dict:
        """After the last step: every group must end with the same weights."""
        return {"ft_weights_digest": self.weights_digest()}

    def watch_hangs(self, on_hang: Callable[[str], None]) -> HangWatch:
        """From the first step on: a loop with no progress takes this group out of the quorum, after `on_hang`
        (this rank's stacks to the store; at most STACKS_WAIT_S) and no run restart: the group's restart heals
        from a live peer (kiln.trainer.membership.hang_watch). The watch that torchft's waits above pause."""
        def verdict(why: str) -> None:
            record = threading.Thread(target=on_hang, args=(why,), name="kiln-ft-hang-stacks", daemon=True)
            record.start()
            record.join(STACKS_WAIT_S)  # a slow store must not keep the hung group in the others' quorum
            leave(self.group, why, lambda: self.manager.shutdown(wait=False))

        self.watch.start(verdict)
        return self.watch

    def close(self) -> None:
        self.watch.stop()
        self.manager.shutdown(wait=False)
