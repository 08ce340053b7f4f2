"""LoRA runs of `kiln train` on real torchrun + gloo ranks, from a Llama folder made by transformers.

- the first step's loss is transformers' loss of the base on that batch (the adapters start as a no-op); a run
  under FSDP2 (dp2) and one under tensor parallelism (tp2: the adapters follow the base's column-/row-wise plan)
  give the same loss curve;
- a commit holds the adapters and their optimizer state only, and a 2-rank commit resumes on 1 rank with the
  same curve; the same commit on another base is refused in one line naming both;
- `kiln export --format peft` gives a folder peft loads over the base, with kiln's logits; `--format hf --merge`
  gives the merged model, which transformers loads with the same logits.
Tolerance 1e-4 absolute on losses, as tests/distributed/test_trainer_layouts.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.hf_models import VOCAB, save_model
from tests.support.runs import kiln, torchrun_train, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-4
ADAPTER = {"rank": 4, "alpha": 8}
# constant learning rate: a run of 2 steps resumed to 4 sees the same rates as a run of 4
TRAINING = {"schedule": "constant", "lr": 1e-2}


def lora_spec(path, folder, ckpt, *, steps: int, nproc: int, parallelism: dict | None = None):
    return write_spec(path, model={"from": f"file://{folder}", "seqLen": 32, "adapter": ADAPTER}, nproc=nproc,
                      training={**TRAINING, "steps": steps}, parallelism=parallelism,
                      checkpoint={"uri": f"file://{ckpt}"})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step LoRA run on 2 FSDP2 ranks: (tmp, base folder, base model, losses, checkpoint folder)."""
    tmp = tmp_path_factory.mktemp("lora")
    folder = tmp / "base"
    base = save_model(folder, "gqa")
    ckpt = tmp / "ckpt"
    records = torchrun_train(lora_spec(tmp / "spec.yaml", folder, ckpt, steps=4, nproc=2), tmp / "out", 2)
    return tmp, folder, base, [r["loss"] for r in records], ckpt


def test_first_loss_is_the_bases_and_tp_gives_the_fsdp_curve(run):
    from kiln.trainer.data.loader import GlobalBatchLoader, open_source
    from kiln.trainer.model.hf_folder import load_tokenizer

    tmp, folder, base, losses, _ = run
    loader = GlobalBatchLoader(open_source("builtin:pydoc", seq_len=32, vocab_size=VOCAB, seed=3,
                                           tokenizer=load_tokenizer(f"file://{folder}")), seed=3)
    inputs, targets = loader.next_batch(4)
    with torch.no_grad():
        first = torch.nn.functional.cross_entropy(base(inputs).logits.flatten(0, 1), targets.flatten())
    assert losses[0] == pytest.approx(float(first), abs=1e-5)
    spec = lora_spec(tmp / "tp.yaml", folder, tmp / "ckpt-tp", steps=4, nproc=2, parallelism={"tensor": 2})
    tp = torchrun_train(spec, tmp / "out-tp", 2)
    assert [r["tp"] for r in tp] == [2] * 4
    assert [r["loss"] for r in tp] == pytest.approx(losses, abs=TOL)


def test_commit_holds_adapters_only_and_resumes_on_one_rank_with_the_same_curve(run, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    _, folder, _, losses, _ = run
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    torchrun_train(lora_spec(tmp_path / "a.yaml", folder, ckpt, steps=2, nproc=2), out, 2)
    keys = set(FileSystemReader(str(ckpt / "step-00000002")).read_metadata().state_dict_metadata)
    tensors = {k for k in keys if k.startswith(("model.", "optim.state."))}
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert len([k for k in tensors if k.startswith("model.")]) == 2 * 7 * 2  # A, B x 7 projections x 2 blocks
    resumed = torchrun_train(lora_spec(tmp_path / "b.yaml", folder, ckpt, steps=4, nproc=1), out, 1)
    assert [(r["step"], r["world_size"]) for r in resumed] == [(1, 2), (2, 2), (3, 1), (4, 1)]
    assert [r["loss"] for r in resumed] == pytest.approx(losses, abs=TOL)

    other = tmp_path / "other"  # the same shapes, another index: another base
    save_model(other, "tied")
    proc = kiln("train", "--config", str(lora_spec(tmp_path / "c.yaml", other, ckpt, steps=6, nproc=1)),
                "--output", str(tmp_path / "out-other"))
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("kiln: error: checkpoint ") and "holds LoRA adapters trained on base" in line
    assert f"file://{folder}" in line and f"file://{other}" in line and "Traceback" not in proc.stderr


def test_peft_export_loads_in_peft_and_merged_export_in_transformers(run, tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from kiln.api.load import load_file
    from kiln.trainer.evaluate import initial_model, load_checkpoint
    from kiln.trainer.model.hf_folder import resolve_dims

    tmp, folder, _, _, ckpt = run
    spec = tmp / "spec.yaml"
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    proc = kiln("export", str(spec), "--format", "peft", "--output", f"file://{adapter_dir}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    proc = kiln("export", str(spec), "--format", "hf", "--merge", "--output", f"file://{merged_dir}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    refused = kiln("export", str(spec), "--output", f"file://{tmp_path / 'plain'}")
    assert refused.returncode == 1 and "--format peft" in refused.stderr.strip().splitlines()[-1]

    doc = load_file(spec)[0]
    ours = initial_model(doc, resolve_dims(doc.spec), torch.device("cpu"))
    assert load_checkpoint(ours, doc, f"file://{ckpt}") == 4
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    base = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(tokens).logits
        theirs = PeftModel.from_pretrained(base, adapter_dir).eval()(input_ids=tokens).logits
        merged = LlamaForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32).eval()(tokens).logits
        mine = ours(tokens)
    assert (mine - theirs).abs().max() < 1e-4
    assert (merged - theirs).abs().max() < 1e-4
    assert (mine - before).abs().max() > 1e-3  # the adapters changed the model
    shutil.rmtree(merged_dir)


def test_bf16_run_keeps_the_frozen_base_in_bf16_and_trains_fp32_adapters(run, tmp_path):
    """training.precision bf16 under FSDP2: a block's frozen bf16 base and fp32 adapters share one FSDP unit (the
    cast itself: tests/unit/test_lora.py); the adapters, their AdamW state and so the commit are fp32, and the
    curve follows the fp32 run's within bf16's rounding."""
    from torch.distributed.checkpoint import FileSystemReader

    _, folder, _, losses, _ = run
    ckpt = tmp_path / "ckpt"
    spec = write_spec(tmp_path / "bf16.yaml", model={"from": f"file://{folder}", "seqLen": 32, "adapter": ADAPTER},
                      nproc=2, training={**TRAINING, "steps": 2, "precision": "bf16"},
                      checkpoint={"uri": f"file://{ckpt}"})
    records = torchrun_train(spec, tmp_path / "out", 2)
    assert [r["loss"] for r in records] == pytest.approx(losses[:2], abs=0.02)
    meta = FileSystemReader(str(ckpt / "step-00000002")).read_metadata().state_dict_metadata
    dtypes = {k: m.properties.dtype for k, m in meta.items() if k.startswith(("model.", "optim.state."))
              and not k.endswith(".step")}
    assert dtypes and set(dtypes.values()) == {torch.float32}
    assert len([k for k in dtypes if k.startswith("optim.state.")]) == 2 * 2 * 7 * 2  # exp_avg(_sq) of each
