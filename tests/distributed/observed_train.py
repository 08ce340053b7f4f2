"""`kiln train` with observers, for tests that must see what the run computes in, not only its losses.

Run under torchrun in place of `-m kiln.cli.main`: it installs the observers, runs `kiln` with the same
arguments, and writes `$KILN_OBSERVE_DIR/rank-<RANK>.json`:

- `activations`: {module class: sorted dtypes of its outputs}, from a global forward hook (nn.Linear's output
  is the dtype its matmul ran in);
- `collectives`: {"<function> <dtype>": calls} for the torch.distributed collectives FSDP2 and DDP hooks call
  (the reduce of gradients shows its dtype here);
- `optimizer_params`: sorted dtypes of the tensors the optimizer steps (the master weights);
- `powersgd`: {"hook_calls", "uncompressed_calls"}: calls of torch's PowerSGD hook, and how many of them
  took its plain all-reduce (the warm-up) instead of compressing;
- `kernels`: {"<triton|reference> <op> <tensor types of its arguments>": calls}: which implementation each
  call of kiln.trainer.model.kernels took, and with what (Tensor, Parameter, DTensor);
- `parameters`: {name: dtype} of the run's model on this rank once built (parallelized and allocated), as it
  stores them (FSDP2's shards, not the dtype it gathers them in for compute).

Nothing here changes what the run does; every observer only records and calls through.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

COLLECTIVES = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce", "all_gather_single",
               "all_gather_into_tensor")

activations: dict[str, set[str]] = collections.defaultdict(set)
collectives: collections.Counter = collections.Counter()
optimizer_params: set[str] = set()
powersgd = {"hook_calls": 0, "uncompressed_calls": 0}
kernels: collections.Counter = collections.Counter()
kernels_counted = False
parameters: dict[str, str] = {}
KERNEL_OPS = ("rms_norm", "swiglu", "apply_rope", "fused_linear_cross_entropy")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _forward_hook(module, args, output):
    for t in _tensors(output):
        activations[type(module).__name__].add(str(t.dtype))


def _counting(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tensor is not None:
            collectives[f"{name} {tensor.dtype}"] += 1
        return fn(*args, **kwargs)
    return wrapper


def _optimizer_pre_hook(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        optimizer_params.update(str(p.dtype) for p in group["params"])


def _recording_parameters(build):
    @functools.wraps(build)
    def wrapper(run):
        build(run)
        # recorded now, not from a model kept alive to the end: no reference outlives the run
        parameters.update({n: str(p.dtype) for n, p in run.model.named_parameters()})
    return wrapper


def install() -> None:
    from kiln.trainer import run

    run.build_model_parts = _recording_parameters(run.build_model_parts)  # looked up when a Run is built
    torch.nn.modules.module.register_module_forward_hook(_forward_hook)
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _counting(name, getattr(dist, name)))
    register_optimizer_step_pre_hook(_optimizer_pre_hook)

    plain = default_hooks._allreduce_fut  # what powerSGD_hook calls, through its module, for plain steps

    def counted_plain(*args, **kwargs):
        powersgd["uncompressed_calls"] += 1
        return plain(*args, **kwargs)

    default_hooks._allreduce_fut = counted_plain
    hook = powerSGD_hook.powerSGD_hook

    @functools.wraps(hook)
    def counted_hook(state, bucket):
        powersgd["hook_calls"] += 1
        return hook(state, bucket)

    powerSGD_hook.powerSGD_hook = counted_hook  # looked up when kiln registers it
    count_kernels()


def count_kernels() -> None:
    """Count each call of kiln.trainer.model.kernels' ops into `kernels`, by implementation and argument types."""
    global kernels_counted
    from kiln.trainer.model import kernels as switch

    kernels_counted = True

    # The switch calls `ops.<op>` / `reference.<op>` through the modules: wrapping their attributes sees each call.
    for impl, module in (("triton", switch._TRITON_OPS), ("reference", switch.reference)):
        for op in KERNEL_OPS if module is not None else ():
            setattr(module, op, _kernel_counting(impl, op, getattr(module, op)))


def _kernel_counting(impl, op, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        types = sorted({type(a).__name__ for a in args if isinstance(a, torch.Tensor)})
        kernels[f"{impl} {op} {','.join(types)}"] += 1
        return fn(*args, **kwargs)
    return wrapper


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"activations": {k: sorted(v) for k, v in activations.items()}, "collectives": dict(collectives),
              "optimizer_params": sorted(optimizer_params), "powersgd": powersgd, "kernels": dict(kernels),
              "parameters": parameters}
    (out / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    install()
    from kiln.cli import rank_cmds
    from kiln.cli.main import main

    out = Path(os.environ["KILN_OBSERVE_DIR"])
    rank_cmds.before_leaving.append(lambda code: write(out))  # a finished `kiln train` ends the process itself
    try:
        code = main(sys.argv[1:])
    finally:
        write(out)  # an error comes back here
    sys.exit(code)
