"""One torchrun rank for tests/distributed/test_hf_import.py: import Hugging Face folders into kiln's model,
parallelised as the trainer does it (FSDP2, TP or PP over the ranks), and write kiln's logits.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.distributed.hf_worker CASES.json OUT_DIR

CASES.json: [{"name", "folder", "layout": {"tensor", "pipeline"}, "tokens": path of a saved (batch, seq) tensor}].
Each rank that holds the logits (every rank, or the last pipeline stage) saves OUT_DIR/<name>-rank<r>.pt with the
logits and the bytes it read from the folder; with "grads": true (layouts without a pipeline) also the gradient
of every parameter, whole and by its transformers name, of the mean next-token loss of those tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(cases_path: str, out_dir: str) -> None:
    from kiln.api.spec import TrainingSpecSpec
    from kiln.trainer.model import hf_folder as hf, kernels
    from kiln.trainer.build import init_distributed
    from kiln.trainer.model.transformer import build_model
    from kiln.trainer.parallel.parallelize import build_mesh, parallelize, plan_layout

    rank, world, device = init_distributed()
    kernels.set_mode("reference")
    for case in json.loads(Path(cases_path).read_text()):
        spec = TrainingSpecSpec.model_validate({
            "model": {"from": f"file://{case['folder']}", "seqLen": 32},
            "training": {"globalBatchSize": 2 * world, "microBatchSize": 1, "precision": "fp32", "steps": 1},
            "parallelism": {"compile": False, "kernels": "reference", **case["layout"]},
            "resources": {"processesPerNode": world},
        })
        dims = hf.resolve_dims(spec)
        layout = plan_layout(spec, dims, world)
        mesh = build_mesh(layout, device.type)
        model = parallelize(build_model(dims), mesh, layout, spec)
        model.to_empty(device=device)
        model.init_buffers()
        read = hf.load_weights(model, spec.model.from_, dims)
        tokens = torch.load(case["tokens"])
        grads = None
        if case.get("grads") and layout.pp == 1:
            logits = model(tokens)
            torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
            grads = {hf.hf_name(n, dims.arch): full(p.grad) for n, p in model.named_parameters()}
            logits = logits.detach()
        with torch.no_grad():
            if grads is not None:
                pass  # the logits of the forward that gave the gradients
            elif layout.pp == 1:
                logits = model(tokens)
            else:  # two stages: the first sends its hidden states to the second, which computes the logits
                stage = mesh["pp"].get_local_rank()
                peer = mesh["pp"].mesh.tolist()[1 - stage]
                if stage == 0:
                    dist.send(model(tokens).contiguous(), dst=peer)
                    logits = None
                else:
                    # under TP the hidden states between blocks are sharded on the sequence (kiln.trainer.parallel.parallelize)
                    hidden = torch.empty(tokens.shape[0], tokens.shape[1] // layout.tp, dims.dim)
                    dist.recv(hidden, src=peer)
                    logits = model(hidden)
        torch.save({"logits": logits, "read_bytes": read, "grads": grads},
                   Path(out_dir) / f"{case['name']}-rank{rank}.pt")
    dist.destroy_process_group()


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


if __name__ == "__main__":
    main(*sys.argv[1:3])
