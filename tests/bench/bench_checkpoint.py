"""Checkpoint benchmark: loop blocking time (async vs sync save), upload throughput (vs a plain minio multipart
PUT of the same bytes to the same server), restore time (vs a plain parallel ranged GET of the same bytes).

    python -m tests.bench.bench_checkpoint                       # CPU, kiln model (small preset, trimmed)
    python -m tests.bench.bench_checkpoint --device cuda --preset llama-1b   # H200: llama-1b + AdamW state
    python -m tests.bench.bench_checkpoint --uri file:///scratch/ckpt          # a file store, no S3 server

The S3 server is --endpoint (credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), else the running rig's,
else a private versitygw from the rig's build. Writes JSON to --out (default runs/bench/checkpoint.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from kiln.api.presets import PRESETS, ModelDims, llama_ffn_dim
from kiln.api.spec import CheckpointSpec
from kiln.storage import open_store
from kiln.storage.commit import read_commit
from kiln.trainer.checkpoint.checkpointer import Checkpointer
from kiln.trainer.model.transformer import build_model
from tests.bench.report import write_report

MiB = 1 << 20


def _server(args) -> tuple[str, dict, object | None]:
    """(endpoint, credentials env, process to stop)."""
    if args.endpoint:
        return args.endpoint, {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}, None
    from tests.rig import build, cluster

    rig = cluster.running()
    if rig is not None:
        return (
            rig.s3_endpoint,
            {"AWS_ACCESS_KEY_ID": rig.s3_access_key, "AWS_SECRET_ACCESS_KEY": rig.s3_secret_key},
            None,
        )
    from tests.support.s3 import ACCESS, SECRET, PrivateS3

    if not build.is_built("versitygw"):
        build.build(["versitygw"])
    data = Path(tempfile.mkdtemp(prefix="kiln-bench-s3-")) / "data"
    (data / "kiln").mkdir(parents=True)
    server = PrivateS3(data)
    server.start()
    return server.endpoint, {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET}, server


def _state(args, device: torch.device):
    dims = dict(PRESETS[args.preset])
    if args.layers:
        dims["layers"] = args.layers
    if args.vocab_size:
        dims["vocab_size"] = args.vocab_size
    dims.setdefault("ffn_dim", llama_ffn_dim(dims["dim"]))
    model = build_model(ModelDims(**dims))
    model.to_empty(device=device)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step creates the AdamW moments: the full state a run checkpoints
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt, sum(p.numel() for p in model.parameters())


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layers (CPU default 4)")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary (CPU default 8192)")
    parser.add_argument("--endpoint", default=None, help="S3 endpoint; default: the rig's, or a private versitygw")
    parser.add_argument("--bucket", default="kiln")
    parser.add_argument("--uri", default=None, help="file:///dir: benchmark a file store instead of S3")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="runs/bench/checkpoint.json")
    args = parser.parse_args()
    if args.device == "cpu" and args.preset == "small":
        args.layers = args.layers or 4
        args.vocab_size = args.vocab_size or 8192
    device = torch.device(args.device)

    if args.uri:  # file://: no S3 server; the reference is a plain copy of the same bytes into the same place
        endpoint, server, uri = None, None, args.uri.rstrip("/") + f"/bench-ckpt-{uuid.uuid4().hex}/"
    else:
        endpoint, env, server = _server(args)
        os.environ.update(env)
        uri = f"s3://{args.bucket}/bench-ckpt/{uuid.uuid4().hex}/"
    try:
        model, opt, params = _state(args, device)
        results: dict = {
            "device": args.device,
            "preset": args.preset,
            "layers": args.layers,
            "params": params,
            "endpoint": endpoint,
            "host": platform.node(),
            "cpus": os.cpu_count(),
        }

        def checkpointer(sub: str, async_save: bool) -> Checkpointer:
            spec = CheckpointSpec(uri=uri + sub + "/", endpoint=endpoint, keep=1, async_save=async_save)
            return Checkpointer(spec, default_uri="", rank=0, world_size=1)

        # The reference: a plain minio multipart PUT (fput_object, same part size and parallelism as the
        # checkpoint's uploads) of as many bytes as one checkpoint, and a plain parallel ranged GET of them back
        # (file://: an atomic copy into the same directory). Each checkpoint measurement is paired with a
        # reference measurement taken right after it, so a busy machine slows both alike.
        store = open_store(uri + "ref/", endpoint=endpoint)
        blob = tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR"))

        def put() -> None:
            if args.uri:
                store.put_file("blob", blob.name)
            else:
                store.client.fput_object(
                    store.bucket,
                    store.prefix + "blob",
                    blob.name,
                    part_size=store.part_size,
                    num_parallel_uploads=store.parallelism,
                )

        # 1. synchronous save: the loop is blocked for all of it (stage + serialise + hash + upload + commit)
        sync = checkpointer("sync", async_save=False)
        sync_s, put_s = [], []
        for i in range(args.repeats):
            sync_s.append(_time(lambda i=i: sync.save(i + 1, [model], [opt], {"step": i + 1})))
            if i == 0:  # now the size is known: write the reference file
                ckpt_bytes = sum(e.size for e in read_commit(sync.store, 1).files.values())
                chunk = os.urandom(16 * MiB)
                for off in range(0, ckpt_bytes, len(chunk)):
                    blob.write(chunk[: min(len(chunk), ckpt_bytes - off)])
                blob.flush()
            put_s.append(_time(put))
        sync.close()

        # 2. asynchronous save: the loop is blocked only for staging; the rest is measured after wait()
        asy = checkpointer("async", async_save=True)
        block_s, total_s = [], []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            asy.save(i + 1, [model], [opt], {"step": i + 1})
            block_s.append(time.perf_counter() - t0)
            asy.wait()
            total_s.append(time.perf_counter() - t0)
        asy.close()

        # 3. restore of the async checkpoint (download, check sha256 of every file, DCP load), paired with a GET
        model2, opt2, _ = _state(args, device)
        restore_s, get_s = [], []
        for _ in range(args.repeats):
            restore_s.append(_time(lambda: checkpointer("async", True).restore([model2], [opt2])))
            get_s.append(_time(lambda: store.get_file("blob", blob.name + ".back")))
        os.unlink(blob.name + ".back")
        blob.close()

        best = min
        results.update(
            checkpoint_bytes=ckpt_bytes,
            sync_save_blocking_s=best(sync_s),
            async_save_blocking_s=best(block_s),
            blocking_ratio_sync_over_async=best(sync_s) / best(block_s),
            async_save_total_s=best(total_s),
            checkpoint_throughput_MiBps=ckpt_bytes / MiB / best(sync_s),
            plain_put_throughput_MiBps=ckpt_bytes / MiB / best(put_s),
            throughput_ratio_vs_plain_put=best(put_s) / best(sync_s),
            throughput_ratio_vs_plain_put_paired_median=statistics.median(p / s for p, s in zip(put_s, sync_s)),
            background_throughput_ratio_vs_plain_put=best(put_s) / (best(total_s) - best(block_s)),
            restore_s=best(restore_s),
            plain_get_s=best(get_s),
            restore_ratio_vs_plain_get=best(get_s) / best(restore_s),
            restore_ratio_vs_plain_get_paired_median=statistics.median(g / r for g, r in zip(get_s, restore_s)),
            raw={
                "sync_s": sync_s,
                "async_block_s": block_s,
                "async_total_s": total_s,
                "put_s": put_s,
                "get_s": get_s,
                "restore_s": restore_s,
            },
        )
    finally:
        try:
            open_store(uri, endpoint=endpoint).delete_prefix("")
        finally:
            if server is not None:
                server.stop()
    write_report(results, args.out, summary={k: v for k, v in results.items() if k != "raw"})


if __name__ == "__main__":
    main()
