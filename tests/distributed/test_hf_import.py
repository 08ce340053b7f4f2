"""Hugging Face models in and out, checked against transformers itself (tests/hf_models.py makes the models).

- kiln imports small random Llamas (GQA, tied embeddings, llama3 rope scaling; one sharded with an index) under
  FSDP2 (dp2), tensor parallel (tp2) and pipeline parallel (pp2) on 2 real gloo ranks under torchrun, and their
  mixes on 4: its logits equal transformers' within fp32 tolerance, and each rank reads only its share;
- the same for a Qwen2 (q/k/v biases) and a Gemma 3 (per-head q/k norms, sandwich norms, GeGLU, sliding layers
  with their own RoPE base) folder, whose gradients under dp2 and tp2 are also transformers' own;
- a short 2-rank fine-tune from a model folder (a tied Llama under FSDP2; a Gemma 3 under tensor parallel with
  selective activation checkpointing), exported with `kiln export`, loads in transformers (model and tokenizer),
  generates, and gives kiln's own logits of that checkpoint; the run resumes on 1 rank (another world size) from
  its own commit without the folder's weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hf_models import FAMILIES, VARIANTS, VOCAB, save_model
from tests.support.runs import env, kiln, torchrun_train, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _folder_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(st.get_tensor(k).nbytes for k in st.keys())
    return total


# (ranks, layouts, model folders): every variant on 2 ranks; the mixes (FSDP2 x TP, PP x TP, PP x FSDP2) on 4
CASES = {
    "2-ranks": (2, {"dp2": {"tensor": 1, "pipeline": 1}, "tp2": {"tensor": 2}, "pp2": {"pipeline": 2}},
                [*VARIANTS, "sharded"]),
    "4-ranks-mixed": (4, {"fsdp2xtp2": {"tensor": 2}, "pp2xtp2": {"tensor": 2, "pipeline": 2},
                          "pp2xfsdp2": {"pipeline": 2}}, ["tied"]),
    "2-ranks-families": (2, {"dp2": {"tensor": 1, "pipeline": 1}, "tp2": {"tensor": 2}, "pp2": {"pipeline": 2}},
                         ["qwen2", "gemma3"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_and_each_rank_reads_only_its_share(tmp_path, case):
    nproc, layouts, names = CASES[case]
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
    torch.save(tokens, tmp_path / "tokens.pt")
    refs, ref_grads, sizes, cases = {}, {}, {}, []
    for name in names:
        folder = tmp_path / name
        family = name in FAMILIES  # untied: transformers' tied embedding's gradient is the sum of kiln's two
        # "sharded": GQA weights cut into several files with model.safetensors.index.json
        model = save_model(folder, "gqa" if name == "sharded" else name, tokenizer=False,
                           config_overrides={"tie_word_embeddings": False} if family else None,
                           **({"max_shard_size": "20KB"} if name == "sharded" else {}))
        logits = model(tokens).logits
        if family:
            torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
            ref_grads[name] = {n: p.grad for n, p in model.named_parameters()}
        refs[name] = logits.detach()
        sizes[name] = _folder_bytes(folder)
        for layout, par in layouts.items():
            cases.append({"name": f"{name}-{layout}", "folder": str(folder), "layout": par, "grads": family,
                          "tokens": str(tmp_path / "tokens.pt")})
    if "sharded" in names:
        assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
        assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           "-m", "tests.distributed.hf_worker", str(tmp_path / "cases.json"), str(out)],
                          env=env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for case in cases:
        name, layout = case["name"].rsplit("-", 1)
        results = [torch.load(out / f"{case['name']}-rank{r}.pt") for r in range(nproc)]
        holders = [r for r in results if r["logits"] is not None]
        assert len(holders) == (nproc // 2 if layout.startswith("pp2") else nproc), case["name"]
        for r in holders:
            torch.testing.assert_close(r["logits"], refs[name], rtol=1e-5, atol=1e-5, msg=case["name"])
            if r["grads"] is not None:
                assert r["grads"].keys() == ref_grads[name].keys(), case["name"]
                for n, g in r["grads"].items():
                    torch.testing.assert_close(g, ref_grads[name][n], rtol=1e-4, atol=1e-6, msg=f"{case['name']} {n}")
        read = [r["read_bytes"] for r in results]
        # kiln holds the output layer on its own: a tied model's embedding is read a second time for it
        model_bytes = sizes[name] + (VOCAB * 32 * 4 if name == "tied" else 0)
        assert max(read) < 0.75 * model_bytes * 2 / nproc, (case["name"], read, model_bytes)  # its share only
        if "tp2" not in layout:  # FSDP and PP split every tensor or block once; TP replicates the norms
            assert sum(read) == model_bytes, (case["name"], read, model_bytes)
    if "llama3" in names:  # the llama3 scaling is not a no-op at these positions
        assert not torch.allclose(refs["llama3"], refs["gqa"])


@pytest.mark.parametrize("variant,parallelism", [("tied", {}),
                                                   ("gemma3", {"tensor": 2, "activationCheckpoint": "selective"})])


def test_finetune_export_reload_in_transformers_and_resume_without_the_folder(tmp_path, variant, parallelism):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.api.load import load_file
    from kiln.trainer.evaluate import initial_model, load_checkpoint
    from kiln.trainer.data.loader import GlobalBatchLoader, open_source
    from kiln.trainer.model.hf_folder import load_tokenizer, resolve_dims

    folder = tmp_path / "base"
    base = save_model(folder, variant)
    # as published folders have: without it AutoTokenizer picks the family's class (Gemma's wants an <unk>)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    ckpt = tmp_path / "ckpt"
    spec = write_spec(tmp_path / "spec.yaml", model={"from": f"file://{folder}", "seqLen": 32}, nproc=2,
                      training={"steps": 3, "lr": 3e-3, "globalBatchSize": 4},
                      checkpoint={"uri": f"file://{ckpt}"}, parallelism=parallelism)
    records = torchrun_train(spec, tmp_path / "run", 2)
    assert [r["step"] for r in records] == [1, 2, 3]
    # step 1 trained the imported model: its loss is transformers' loss of the folder's model on that batch
    # (builtin:pydoc tokenized with the folder's tokenizer.json, the loader's first global batch)
    tok = load_tokenizer(f"file://{folder}")
    loader = GlobalBatchLoader(open_source("builtin:pydoc", seq_len=32, vocab_size=VOCAB, seed=3, tokenizer=tok),
                               seed=3)
    inputs, targets = loader.next_batch(4)
    with torch.no_grad():
        first = torch.nn.functional.cross_entropy(base(inputs).logits.flatten(0, 1), targets.flatten())
    assert records[0]["loss"] == pytest.approx(float(first), rel=1e-5)

    export = tmp_path / "export"
    proc = kiln("export", str(spec), "--checkpoint", f"file://{ckpt}", "--output", f"file://{export}",
                "--max-shard-size", "30KB")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exported step 3" in proc.stdout
    assert (export / "model.safetensors.index.json").exists() and len(list(export.glob("*.safetensors"))) > 1
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in export.iterdir()}

    hf_model = AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(hf_model) is type(base)
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer("The try statement", return_tensors="pt").input_ids
    generated = hf_model.generate(ids, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 6

    doc = load_file(spec)[0]
    dims = resolve_dims(doc.spec)
    kiln_model = initial_model(doc, dims, torch.device("cpu"), load_from=False)
    assert load_checkpoint(kiln_model, doc, f"file://{ckpt}") == 3
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, kiln_model(tokens), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(base(tokens).logits, kiln_model(tokens), atol=1e-3)  # it did fine-tune

    # a resumed run, on 1 rank, loads its own commit: the folder's weights are not read again (they are gone now)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    longer = write_spec(tmp_path / "longer.yaml", model={"from": f"file://{folder}", "seqLen": 32}, nproc=1,
                        training={"steps": 4, "lr": 3e-3, "globalBatchSize": 4}, checkpoint={"uri": f"file://{ckpt}"})
    records = torchrun_train(longer, tmp_path / "resumed", 1)
    assert [r["step"] for r in records] == [4]
