"""Silent data corruption checks: replica comparison and the seal on every rank's own shards (kiln.trainer.guards.step says when they run)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kiln.trainer.guards.step import _comm_device

# torch is imported lazily, as in kiln.trainer.guards.step.

log = logging.getLogger("kiln.guards")



# Under the run's checkpoint URI: one JSON object (step, suspect ranks, detail, time) per SDC mismatch the run
# met; kept across restarts and never pruned with the checkpoints.
SDC_INCIDENTS = "incidents/sdc/"


class SilentDataCorruption(RuntimeError):
    """Replicas that must hold bit-identical weights (or agree on a loss) do not; the step must not commit."""

    def __init__(self, step: int, ranks: list[int], detail: str) -> None:
        self.step, self.ranks, self.detail = step, sorted(ranks), detail
        super().__init__(f"silent data corruption at step {step}: suspect rank(s) {self.ranks}: {detail}")


_INT_VIEW = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
_PRIME = 65521  # position weights 1..65521 make a flip's effect depend on where it happened


def tensor_fingerprint(t):
    """Two int64 checksums of the raw bits of `t` (computed on its device; wrap-around is deterministic)."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    bits = flat.view(getattr(torch, _INT_VIEW[flat.element_size()])).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % _PRIME + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])




def _suspects(rows: list[tuple], group_ranks: list[int]) -> list[int]:
    """Ranks whose fingerprint differs from the majority; every rank when there is no strict majority."""
    counts: dict[tuple, int] = {}
    for r in rows:
        counts[r] = counts.get(r, 0) + 1
    best, n = max(counts.items(), key=lambda kv: kv[1])
    if n * 2 <= len(rows):  # 1-vs-1 (or a tie): cannot tell who is wrong, name all of them
        return list(group_ranks)
    return [rank for rank, row in zip(group_ranks, rows) if row != best]


@dataclass
class SdcCheck:
    """Every `every` steps: compare the weights with their replicas and with their seal; raise naming the
    rank(s). The seal is taken after the update of the step before a due step and verified before the due
    step's update, so each check covers one step's forward and backward."""

    every: int = 100
    group: Any = None  # for plain-tensor (DDP/replicated) params: the ranks that hold identical copies
    checks: int = field(default=0, init=False)  # due steps at which weights were compared with something
    mismatches: int = field(default=0, init=False)
    _sealed: tuple | None = field(default=None, init=False)  # (step, [ranks, 2] digests, {name: fingerprint})
    _counted: int | None = field(default=None, init=False)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def seal_due(self, step: int) -> bool:
        return self.due(step + 1)

    def _count(self, step: int) -> None:
        if self._counted != step:
            self._counted = step
            self.checks += 1

    def seal(self, model_parts, step: int, optimizers=()) -> None:
        """After `step`'s update: fingerprint this rank's parameters and optimizer state; every rank keeps
        every rank's digest (collective over the job)."""
        fps = _state_fingerprints(model_parts, optimizers)
        self._sealed = (step, _all_digests(fps), fps)

    def verify_seal(self, model_parts, step: int, optimizers=()) -> bool:
        """Before `step`'s update: raise SilentDataCorruption on every rank if any rank's parameters or
        optimizer state changed since the seal of step - 1. False when there is no such seal (the first
        check after a start or a rollback): nothing was compared. Collective over the job."""
        import torch
        import torch.distributed as dist

        sealed, self._sealed = self._sealed, None
        if sealed is None or sealed[0] != step - 1:
            return False
        _, then, mine_then = sealed
        fps = _state_fingerprints(model_parts, optimizers)
        now = _all_digests(fps)
        self._count(step)
        # Every rank compares every rank's digest with its own copy of the seal: the verdict does not rest
        # on the corrupted rank's view of itself, and it is the same on every rank.
        changed = (now != then).any(dim=1).nonzero().flatten().tolist()
        if not changed:
            return True
        self.mismatches += 1
        names = [n for n, fp in fps.items() if not torch.equal(fp, mine_then.get(n, fp))]
        detail = f"{', '.join(names[:5])}{' …' if len(names) > 5 else ''}" if names else ""
        details = [detail]
        if dist.is_available() and dist.is_initialized():
            details = [None] * dist.get_world_size()
            dist.all_gather_object(details, detail)
        where = "; ".join(f"rank {r}: {details[r]}" for r in changed if details[r])
        raise SilentDataCorruption(step, changed, f"weights changed between the update of step {step - 1} and "
                                   f"step {step}'s update, with no update in between" + (f" ({where})" if where else ""))

    def verify(self, model, step: int, loss=None, loss_group=None) -> None:
        """Collective over the replica groups of `model`'s parameters (and `loss_group` for the loss).

        Every rank of the job must call it at the same step. Raises SilentDataCorruption on *every* rank
        when any replica group disagrees, before the caller commits anything. Parameters without a
        replicated mesh dimension (plain FSDP over one shard dim) have no second copy here; `seal` and
        `verify_seal` check those.
        """
        import torch
        import torch.distributed as dist

        # (group key) → (process group, [param names], [fingerprints]); DTensor params per replicated mesh dim.
        buckets: dict[tuple, tuple[Any, list[str], list]] = {}
        for name, p in model.named_parameters():
            local, dims = _local_and_replica_groups(p, self.group)
            if not dims:
                continue
            fp = tensor_fingerprint(local)
            for key, pg in dims:
                buckets.setdefault(key, (pg, [], []))
                buckets[key][1].append(name)
                buckets[key][2].append(fp)
        if buckets:
            self._count(step)

        problems: list[tuple[list[int], str]] = []
        for key in sorted(buckets, key=repr):
            pg, names, fps = buckets[key]
            mine = torch.stack(fps)
            dev = _comm_device(pg)
            gathered = [torch.empty_like(mine, device=dev) for _ in range(dist.get_world_size(pg))]
            dist.all_gather(gathered, mine.to(dev), group=pg)
            ranks = dist.get_process_group_ranks(pg)
            table = torch.stack(gathered).cpu()  # [ranks, params, 2]
            bad = (table != table[0]).any(dim=2).any(dim=0).nonzero().flatten().tolist()
            if bad:
                suspects: set[int] = set()
                for i in bad:
                    suspects.update(_suspects([tuple(row[i].tolist()) for row in table], ranks))
                problems.append((sorted(suspects), f"weights differ across replicas {ranks} in "
                                 f"{', '.join(names[i] for i in bad[:5])}{' …' if len(bad) > 5 else ''}"))

        if loss is not None:
            lg = loss_group
            mine = torch.as_tensor(loss, dtype=torch.float64).detach().reshape(1).cpu()
            dev = _comm_device(lg)
            gathered = [torch.empty(1, dtype=torch.float64, device=dev) for _ in range(dist.get_world_size(lg))]
            dist.all_gather(gathered, mine.to(dev), group=lg)
            values = [g.item() for g in gathered]
            ranks = dist.get_process_group_ranks(lg) if lg is not None else list(range(dist.get_world_size()))
            if len({torch.tensor(v, dtype=torch.float64).view(torch.int64).item() for v in values}) > 1:
                problems.append((_suspects([(v,) for v in values], ranks),
                                 f"same-step loss differs across ranks {ranks}: {values}"))

        # Agree on the verdict job-wide, so no rank goes on to commit while another group found corruption.
        world = dist.get_world_size()
        flags = torch.zeros(world + 1, dtype=torch.int32)
        for rs, _ in problems:
            flags[rs] = 1
        flags[world] = int(bool(problems))
        flags = flags.to(_comm_device(None))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        flags = flags.cpu()
        if flags[world]:
            self.mismatches += 1
            details: list = [None] * world
            dist.all_gather_object(details, "; ".join(d for _, d in problems))
            ranks = flags[:world].nonzero().flatten().tolist()
            raise SilentDataCorruption(step, ranks, "; ".join(sorted({d for d in details if d})))

    def describe(self, model_parts) -> str:
        """What a check compares in this layout, for the start of a run."""
        if self.every <= 0:
            return "sdc: off (no weights are compared)"
        import torch.distributed as dist

        dims: set[str] = set()
        for part in model_parts:
            for _, p in part.named_parameters():
                dims.update(key[0] for key, _ in _local_and_replica_groups(p, self.group)[1])
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        replicas = (f"copies compared across {', '.join(sorted(d.replace('plain', 'data parallel') for d in dims))}"
                    if dims else "no replicated copies to compare in this layout")
        return (f"sdc: every {self.every} steps: each rank's weights and optimizer state against their seal "
                f"from the previous step's update (held by all {world} rank(s)); {replicas}")

    def metrics(self) -> dict[str, float]:
        return {"sdc_checks": self.checks, "sdc_mismatches": self.mismatches}


def _state_fingerprints(model_parts, optimizers=()) -> dict:
    """{name: fingerprint} of this rank's local parameters and their optimizer state tensors."""
    import torch
    from torch.distributed.tensor import DTensor

    local = (lambda t: t.to_local() if isinstance(t, DTensor) else t)  # noqa: E731
    fps, names = {}, {}
    for i, part in enumerate(model_parts):
        prefix = f"{i}." if len(model_parts) > 1 else ""
        for name, p in part.named_parameters():
            names[id(p)] = prefix + name
            fps[prefix + name] = tensor_fingerprint(local(p))
    for opt in optimizers:
        for p, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    fps[f"{names.get(id(p), '?')}:{key}"] = tensor_fingerprint(local(value))
    return fps


def _all_digests(fps: dict):
    """Every rank's digest of its fingerprints, [world, 2] int64 on CPU (a collective over the job)."""
    import torch
    import torch.distributed as dist

    dev = _comm_device(None) if dist.is_available() and dist.is_initialized() else torch.device("cpu")
    if fps:
        table = torch.stack([fp.to(dev) for fp in fps.values()])  # [n, 2]; optimizer steps may be on CPU
        weights = torch.arange(1, table.shape[0] + 1, device=table.device, dtype=torch.int64)
        mine = (table * weights[:, None]).sum(dim=0)  # order-sensitive: a change moves the sums
    else:
        mine = torch.zeros(2, dtype=torch.int64)
    if not (dist.is_available() and dist.is_initialized()):
        return mine.cpu()[None]
    gathered = [torch.empty(2, dtype=torch.int64, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine.to(dev))
    return torch.stack(gathered).cpu()


def _local_and_replica_groups(p, default_group):
    """The local bits of `p` and the (key, process group) pairs along which they must be identical."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(p, DTensor):
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
        groups = []
        for dim, placement in enumerate(p.placements):
            if isinstance(placement, Replicate) and mesh.size(dim) > 1:
                pg = mesh.get_group(dim)
                groups.append(((names[dim], tuple(dist.get_process_group_ranks(pg))), pg))
        return p.to_local(), groups
    pg = default_group if default_group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(pg))
    # A plain parameter at one data-parallel rank (no FSDP wrapper, parallel.uses_fsdp) has no second copy.
    return p, [(("plain", ranks), pg)] if len(ranks) > 1 else []
