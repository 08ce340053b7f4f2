"""LoRA on a mixture of experts: `kiln train` on real torchrun + gloo ranks, from a Qwen2-MoE folder made by
transformers (layer 0 routed: 4 experts, top 2, and a shared expert; layer 1 a dense MLP), the router frozen.
With the expert targets, adapters sit on q_proj, gate_proj (the shared expert's and the dense MLP's) and on the
routed experts' stacked weights (experts.gate_up_proj, experts.down_proj: one adapter per expert).

- TP 2 (the MoE runs whole on every TP rank, kiln.trainer.parallel.parallelize._moe_tp_plan) and PP 2 (stage 0
  holds the routed layer, stage 1 the dense one: a target is the whole model's, not each stage's) give one rank's
  loss curve (1e-4, as tests/distributed/test_trainer_layouts.py) and gradient norms;
- EP 2 (each rank holds 2 of the 4 experts and their adapters; tokens go to them and back by all-to-all): 2 steps
  give one rank's losses, and the commit holds the adapters (the experts' whole, all 4) and their optimizer
  state only and resumes on one rank with the uninterrupted curve (its step 3 sees the EP 2 run's updates of A
  and B); with the default targets (experts frozen) EP 2 gives one rank's 4-step curve;
- bf16 at EP 2: the frozen base, experts included, stays bf16, the adapters and their AdamW state fp32, the curve
  and the adapters' updates those of the fp32 run within bf16's rounding;
- a pipeline stage that holds no target is refused in one line naming spec.model.adapter.targets.
Since the adapters' B start at zero, a step's loss depends on the earlier steps' updates of every adapter: expert
adapters that get no gradient in a layout move the curve from step 2 on by 1e-3 to 3e-3, 10 to 30 times the
tolerance. That the expert adapters train, and to what peft computes, is tests/unit/test_lora.py's.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import save_model
from tests.support.runs import commit_tensors, observed, torchrun_kiln, torchrun_train, write_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TOL = 1e-4
EXPERTS = ["q_proj", "gate_proj", "experts.gate_up_proj", "experts.down_proj"]
# constant learning rate: a run of 2 steps resumed to 4 sees the same rates as a run of 4
TRAINING = {"schedule": "constant", "lr": 1e-2}


def moe_spec(tmp, folder, name: str, *, nproc: int, steps: int = 4, parallelism: dict | None = None,
             targets: list[str] | None = EXPERTS, ckpt: str | None = None, **training):
    adapter = {"rank": 4, "alpha": 8, **({"targets": targets} if targets else {})}
    return write_spec(tmp / f"{name}.yaml", model={"from": f"file://{folder}", "seqLen": 32, "adapter": adapter},
                      nproc=nproc, training={**TRAINING, "steps": steps, **training}, parallelism=parallelism,
                      checkpoint={"uri": f"file://{tmp / (ckpt or name)}-ck"})


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The expert targets' 4-step run on one rank: (tmp, base folder, losses, gradient norms); its commit is
    tmp/one-ck."""
    tmp = tmp_path_factory.mktemp("lora-moe")
    folder = tmp / "base"
    save_model(folder, "qwen2_moe")
    records = torchrun_train(moe_spec(tmp, folder, "one", nproc=1), tmp / "out-one", 1)
    losses = [r["loss"] for r in records]
    assert abs(losses[1] - losses[0]) > 1e-3  # the adapters' steps move the loss far beyond TOL
    return tmp, folder, losses, [r["grad_norm"] for r in records]


@pytest.mark.parametrize("parallelism", [{"tensor": 2}, {"pipeline": 2}], ids=["tp2", "pp2"])
def test_expert_adapters_give_the_one_rank_curve_under_tp_and_pp(one_rank, tmp_path, parallelism):
    """The loss curve, and the gradient norm each step clips by: the adapters' gradients over the TP ranks (the
    same on each: counted once) and over the stages (each its own)."""
    _, folder, losses, norms = one_rank
    records = torchrun_train(moe_spec(tmp_path, folder, "run", nproc=2, parallelism=parallelism), tmp_path / "out", 2)
    assert [(r["tp"], r["pp"]) for r in records] == [(parallelism.get("tensor", 1), parallelism.get("pipeline", 1))] * 4
    assert [r["loss"] for r in records] == pytest.approx(losses, abs=TOL)
    assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-4)


def test_a_commit_at_ep2_holds_adapters_only_and_resumes_on_one_rank_with_the_same_curve(one_rank, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    _, folder, losses, _ = one_rank
    out = tmp_path / "out"
    saved = torchrun_train(moe_spec(tmp_path, folder, "ep", nproc=2, steps=2, parallelism={"expert": 2}), out, 2)
    assert [r["ep"] for r in saved] == [2, 2]
    meta = FileSystemReader(str(tmp_path / "ep-ck" / "step-00000002")).read_metadata().state_dict_metadata
    tensors = {k: m for k, m in meta.items() if k.startswith(("model.", "optim.state."))}
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    # A, B x (2 q_proj, the shared expert's and the dense MLP's gate_proj, the 2 expert targets)
    assert len([k for k in tensors if k.startswith("model.")]) == 2 * 6
    experts = [m.size for k, m in tensors.items() if k.startswith("model.") and ".experts." in k]
    assert len(experts) == 4 and {s[0] for s in experts} == {4}  # every expert's, from the 2 ranks' halves
    resumed = torchrun_train(moe_spec(tmp_path, folder, "one", nproc=1, ckpt="ep"), out, 1)
    assert [(r["step"], r["world_size"], r["ep"]) for r in resumed] == [(1, 2, 2), (2, 2, 2), (3, 1, 1), (4, 1, 1)]
    assert [r["loss"] for r in resumed] == pytest.approx(losses, abs=TOL)


def test_default_targets_at_ep2_give_the_one_rank_curve(one_rank, tmp_path):
    """The default targets (attention and MLP projections: the experts frozen, their base sharded by EP)."""
    _, folder, _, _ = one_rank
    one = torchrun_train(moe_spec(tmp_path, folder, "one", nproc=1, targets=None), tmp_path / "o1", 1)
    ep = torchrun_train(moe_spec(tmp_path, folder, "ep", nproc=2, targets=None, parallelism={"expert": 2}),
                        tmp_path / "o2", 2)
    assert [r["ep"] for r in ep] == [2] * 4
    assert [r["loss"] for r in ep] == pytest.approx([r["loss"] for r in one], abs=TOL)


def test_bf16_at_ep2_keeps_the_frozen_experts_in_bf16_and_trains_fp32_expert_adapters(one_rank, tmp_path):
    """training.precision bf16 at EP 2 (FSDP2's mixed precision; the experts sharded over EP): every frozen
    parameter, the routed experts' stacked weights included, is stored in bf16 on every rank, every adapter, the
    experts' too, in fp32, and the optimizer steps fp32 tensors only, whose state the commit holds in fp32.

    The curve follows the fp32 one within 5e-3 absolute: bf16 keeps 8 bits of mantissa, so each weight and
    activation of the base is off by up to 2^-9 (0.2 %) relative; measured, the loss (~6.07) moves by 6e-4 on the
    first step and by up to 1.4e-3 by the fourth, as the rounding feeds the adapters' updates. The loss cannot
    tell whether the expert adapters trained (without their gradient it moves by 1e-3 to 3e-3, bf16's own size),
    so the commit does: every B (zero at the start) has moved the way the fp32 run's has (cosine > 0.98,
    measured > 0.995; an untrained B is zero, cosine 0)."""
    from torch.distributed.checkpoint import FileSystemReader

    tmp, folder, losses, _ = one_rank
    spec = moe_spec(tmp_path, folder, "bf16", nproc=2, parallelism={"expert": 2}, precision="bf16")
    records = torchrun_train(spec, tmp_path / "out", 2, observe=tmp_path / "observed")
    assert [r["loss"] for r in records] == pytest.approx(losses, abs=5e-3)
    for rank in observed(tmp_path / "observed", 2):
        params = rank["parameters"]
        adapters = {n: d for n, d in params.items() if ".lora_A." in n or ".lora_B." in n}
        assert len(adapters) == 12 and set(adapters.values()) == {"torch.float32"}
        frozen = {n: d for n, d in params.items() if n not in adapters}
        assert {n.rsplit(".", 1)[-1] for n in frozen if ".experts." in n} == {"w1", "w2", "w3"}
        assert set(frozen.values()) == {"torch.bfloat16"}
        assert rank["optimizer_params"] == ["torch.float32"]
    commit = tmp_path / "bf16-ck" / "step-00000004"
    meta = FileSystemReader(str(commit)).read_metadata().state_dict_metadata
    dtypes = {k: m.properties.dtype for k, m in meta.items() if k.startswith(("model.", "optim.state."))
              and not k.endswith(".step")}
    assert len(dtypes) == 3 * 12 and set(dtypes.values()) == {torch.float32}  # the adapters, exp_avg(_sq) of each
    ours, fp32 = commit_tensors(commit), commit_tensors(tmp / "one-ck" / "step-00000004")
    b = [k for k in fp32 if ".lora_B." in k]
    assert len(b) == 6 and len([k for k in b if ".experts." in k]) == 2
    for key in b:
        assert torch.nn.functional.cosine_similarity(ours[key].flatten(), fp32[key].flatten(), dim=0) > 0.98, key


def test_a_pipeline_stage_without_a_target_is_refused_naming_the_field(one_rank, tmp_path):
    """The expert targets alone at PP 2: stage 1 (the dense layer) would train nothing, and AdamW refuses an empty
    optimizer. Every rank says so in one line, before any memory is spent, and none is left waiting."""
    _, folder, _, _ = one_rank
    spec = moe_spec(tmp_path, folder, "pp", nproc=2, parallelism={"pipeline": 2}, targets=EXPERTS[2:])
    proc = torchrun_kiln(spec, tmp_path / "out", 2)
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if line.startswith("kiln: error: ")]
    assert said == ["kiln: error: spec.model.adapter.targets: experts.gate_up_proj, experts.down_proj name no module "
                    "of pipeline stage 1 of 2 (spec.parallelism.pipeline; its layers 1 to 1 have down_proj, "
                    "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj); every stage must train an adapter: add a "
                    "target its layers have"] * 2
