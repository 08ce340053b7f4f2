"""Expert parallelism on the CPU: how much of an MoE training step the all-to-alls take at EP 2, against EP 1 (the
same two gloo ranks as plain FSDP data parallelism, no all-to-all) in the same run.

Model: the `tiny-moe` preset (8 experts, top-2, 4 MoE layers), fp32, no compile, the reference kernels. Two gloo
ranks (processes on this machine); each step is the trainer's own (kiln.trainer.parallel.microbatches.accumulate_step, then gradient
clipping and AdamW), on --batch sequences per rank. The EP 1 and EP 2 models step alternately, so both see the
same machine load. Timed on every rank, between barriers: the whole step, and at EP 2 each all-to-all (the
exchange of the per-expert counts, the rows out and back in forward, and their reverses in backward; the bench
routes the rows through a timed autograd function doing the same reverse all-to-all as
`all_to_all_single_autograd`'s backward). An all-to-all's time includes waiting for the slower rank: on a shared
2-core machine that wait is part of what EP costs. Reported: medians over --steps (after --warmup), rank 0's.

    python -m tests.bench.bench_ep [--steps 10] [--out runs/bench/ep.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from tests.bench.report import write_report


def _rank(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from kiln.api import TrainingSpec
    from kiln.trainer.model import hf_folder as hf, kernels
    from kiln.trainer.model.transformer import build_model
    from kiln.trainer.optim import build_optimizer, clip_grad_norm_
    from kiln.trainer.parallel import expert
    from kiln.trainer.parallel.parallelize import build_mesh, parallelize, plan_layout
    from kiln.trainer.parallel.microbatches import accumulate_step

    spent = {"a2a_s": 0.0}
    rows_a2a = expert._all_to_all
    counts_a2a = expert.exchange_counts

    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, output_splits, input_splits, group):
            ctx.splits, ctx.group = (output_splits, input_splits), group
            start = time.perf_counter()
            with torch.no_grad():
                y = rows_a2a(x, output_splits, input_splits, group)
            spent["a2a_s"] += time.perf_counter() - start
            return y

        @staticmethod
        def backward(ctx, grad):
            start = time.perf_counter()
            out = rows_a2a(grad, ctx.splits[1], ctx.splits[0], ctx.group)
            spent["a2a_s"] += time.perf_counter() - start
            return out, None, None, None

    def timed_counts(counts, group):
        start = time.perf_counter()
        received = counts_a2a(counts, group)
        spent["a2a_s"] += time.perf_counter() - start
        return received

    expert._all_to_all = Timed.apply
    expert.exchange_counts = timed_counts

    runs = {}
    for ep in (1, 2):
        spec = TrainingSpec.model_validate({
            "apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "b"},
            "spec": {"model": {"preset": "tiny-moe"},
                     "training": {"globalBatchSize": world * args["batch"], "microBatchSize": args["batch"],
                                  "precision": "fp32", "seed": 0, "gradClip": 1.0},
                     "parallelism": {"compile": False, "kernels": "reference", "expert": ep},
                     "resources": {"processesPerNode": world}},
        }).spec
        dims = hf.resolve_dims(spec)
        layout = plan_layout(spec, dims, world)
        kernels.set_mode(spec.parallelism.kernels)
        model = parallelize(build_model(dims), build_mesh(layout, "cpu"), layout, spec)
        model.to_empty(device="cpu")
        model.init_weights(0)
        runs[ep] = (model, build_optimizer([model], spec.training, torch.device("cpu")), layout, spec)

    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, dims.vocab_size, (args["batch"], dims.seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times = {1: [], 2: []}
    a2a = []
    for i in range(args["warmup"] + args["steps"]):
        for ep, (model, opt, layout, spec) in runs.items():
            dist.barrier()
            spent["a2a_s"] = 0.0
            start = time.perf_counter()
            accumulate_step(model, inputs, targets, layout)
            clip_grad_norm_(list(model.parameters()), spec.training.grad_clip, optimizer=opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.barrier()
            if i >= args["warmup"]:
                times[ep].append(time.perf_counter() - start)
                if ep == 2:
                    a2a.append(spent["a2a_s"])
    return {"step_s_ep1": times[1], "step_s_ep2": times[2], "a2a_s_ep2": a2a,
            "tokens_per_step": world * args["batch"] * dims.seq_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--out", default="runs/bench/ep.json")
    args = parser.parse_args()

    from tests.support.ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_rank, 2, tmp, vars(args))
    r = results[0]
    med = {k: statistics.median(r[k]) for k in ("step_s_ep1", "step_s_ep2", "a2a_s_ep2")}
    a2a_share = statistics.median(a / s for a, s in zip(r["a2a_s_ep2"], r["step_s_ep2"]))
    result = {
        "benchmark": "ep", "model": "tiny-moe", "world": 2, "precision": "fp32",
        "sequences_per_rank": args.batch, "steps": args.steps, "warmup": args.warmup,
        "step_s_median": {"ep1_fsdp2": med["step_s_ep1"], "ep2": med["step_s_ep2"]},
        "tokens_per_s_median": {"ep1_fsdp2": r["tokens_per_step"] / med["step_s_ep1"],
                                "ep2": r["tokens_per_step"] / med["step_s_ep2"]},
        "all_to_all_s_median_ep2": med["a2a_s_ep2"],
        "all_to_all_share_of_step_ep2": a2a_share,
        "per_step": {k: r[k] for k in ("step_s_ep1", "step_s_ep2", "a2a_s_ep2")},
    }
    write_report(result, args.out, summary={k: result[k] for k in (
        "step_s_median", "tokens_per_s_median", "all_to_all_s_median_ep2", "all_to_all_share_of_step_ep2")})


if __name__ == "__main__":
    main()
