"""kiln.api.layout, the one copy of the layout arithmetic: `kiln validate`, the trainer and the elastic
controller accept exactly the same worlds; `kiln run --nproc N` runs a cluster spec on one node of N."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kiln.api import layout, resolve_model
from kiln.api.load import parse
from kiln.api.spec import TrainingSpecSpec
from kiln.control import elastic
from kiln.errors import KilnError
from kiln.trainer.parallel.parallelize import plan_layout


def unchecked(spec: dict) -> TrainingSpecSpec:
    """The spec with every field validated but no cross-field rule run (a spec at a world it may not fit)."""
    fields = {}
    for name, f in TrainingSpecSpec.model_fields.items():
        value = spec.get(f.alias or name)
        if value is not None:
            fields[name] = f.annotation.model_validate(value)
    return TrainingSpecSpec.model_construct(**fields)


def validate_accepts(spec: dict) -> bool:
    """`kiln validate` (every rule, as the apiserver): the world is the one the spec names."""
    try:
        parse({"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "p"}, "spec": spec},
              scope="all")
    except KilnError:
        return False
    return True


def trainer_accepts(spec: TrainingSpecSpec, nodes: int, ppn: int) -> bool:
    """The trainer's own check when torchrun starts nodes x ppn ranks (kiln.trainer.loop calls this)."""
    try:
        plan_layout(spec, resolve_model(spec.model), nodes * ppn, ppn)
    except KilnError:
        return False
    return True


@settings(max_examples=600, deadline=None)
@given(nodes=st.integers(1, 12), ppn=st.sampled_from([1, 2, 3, 4, 6, 8]), tensor=st.sampled_from([1, 2, 3, 4, 8]),
       pipeline=st.sampled_from([1, 2, 3, 4]), replicate=st.sampled_from([1, 2, 3, 4]), fsdp=st.booleans(),
       gbs=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 48, 96]), micro=st.sampled_from([1, 2, 3, 4]),
       pmb=st.sampled_from([None, 1, 2, 3, 4, 6, 8]), heads=st.sampled_from([(4, 2), (6, 3), (8, 8), (12, 4)]),
       layers=st.integers(1, 8), expert=st.sampled_from([1, 1, 2, 3, 4]), experts=st.sampled_from([None, 2, 4, 6]))
def test_validate_trainer_and_elastic_controller_accept_the_same_worlds(nodes, ppn, tensor, pipeline, replicate,
                                                                        fsdp, gbs, micro, pmb, heads, layers,
                                                                        expert, experts):
    parallelism = {"tensor": tensor, "pipeline": pipeline, "replicate": replicate, "fsdp": fsdp, "expert": expert}
    if pmb is not None:
        parallelism["pipelineMicrobatches"] = pmb
    moe = {"moe": {"experts": experts, "topK": 2, "ffnDim": 16}} if experts else {}
    spec = {"model": {"dim": 16 * heads[0], "layers": layers, "heads": heads[0], "kvHeads": heads[1],
                      "vocabSize": 256, "seqLen": 16, **moe},
            "training": {"steps": 10, "globalBatchSize": gbs, "microBatchSize": micro},
            "parallelism": parallelism, "resources": {"nodes": nodes, "gpusPerNode": ppn}}
    validated = validate_accepts(spec)
    s = unchecked({**spec, "elastic": {"minNodes": 1, "maxNodes": 12}})
    assert trainer_accepts(s, nodes, ppn) == validated
    assert (nodes in elastic.valid_node_counts(s)) == validated


def test_validate_used_to_accept_pipeline_microbatches_the_trainer_refuses():
    spec = {"model": {"preset": "tiny"}, "training": {"globalBatchSize": 8, "microBatchSize": 1},
            "parallelism": {"pipeline": 2, "pipelineMicrobatches": 3}, "resources": {"nodes": 1, "gpusPerNode": 2}}
    assert not validate_accepts(spec)
    assert not trainer_accepts(unchecked(spec), 1, 2)
    spec["parallelism"]["pipelineMicrobatches"] = 4
    assert validate_accepts(spec) and trainer_accepts(unchecked(spec), 1, 2)


def test_elastic_controller_skips_node_counts_the_trainer_would_refuse():
    # pipeline 2 over 2 nodes of 2: at 4 nodes each data-parallel rank gets 1 sequence, fewer than the stages
    s = unchecked({"model": {"preset": "tiny"}, "training": {"globalBatchSize": 4, "microBatchSize": 1},
                   "parallelism": {"pipeline": 2}, "resources": {"nodes": 2, "gpusPerNode": 2},
                   "elastic": {"minNodes": 1, "maxNodes": 4}})
    assert elastic.valid_node_counts(s) == [1, 2]
    assert not trainer_accepts(s, 4, 2)


def test_the_layout_of_the_named_world_binds_only_the_cluster():
    # A spec for one node of 1 process with tensor 2 cannot run as written on Kubernetes, but `kiln run --nproc 2`
    # runs it: the layout rules at resources.nodes are the cluster's, kiln run checks its own world.
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "TrainingSpec", "metadata": {"name": "l"},
           "spec": {"model": {"preset": "tiny"}, "parallelism": {"tensor": 2}, "resources": {"nodes": 1}}}
    parse(doc)  # kiln run's (and kiln validate --local's) rules
    with pytest.raises(KilnError, match=r"spec.parallelism: .*world 1\)"):
        parse(doc, scope="all")


# Written for Kubernetes: 4 nodes x 8 GPUs, tensor 2 (data-parallel 16), HSDP over 4 replica groups.
CLUSTER = {"model": {"preset": "tiny"}, "training": {"globalBatchSize": 192, "microBatchSize": 3},
           "parallelism": {"tensor": 2, "replicate": 4}, "resources": {"nodes": 4, "gpusPerNode": 8},
           "elastic": {"minNodes": 2, "maxNodes": 8}}


def local(spec: dict, nproc: int) -> tuple[layout.Layout, list[str]]:
    """fit_local, then the layout of the patched spec at one node of nproc (what kiln run does)."""
    patch, notes = layout.fit_local(unchecked(spec), nproc)
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in spec.items()}
    for section, values in patch.items():
        merged[section] = {k: v for k, v in {**merged.get(section, {}), **values}.items() if v is not None}
    return layout.plan(unchecked(merged), 1, nproc), notes


def test_a_cluster_spec_runs_on_one_machine_with_the_same_global_batch():
    assert validate_accepts(CLUSTER)
    lay, notes = local(CLUSTER, 2)
    assert (lay.tp, lay.dp, lay.dp_replicate) == (2, 1, 1)
    assert lay.grad_accum * lay.micro_batch * lay.dp == 192  # the global batch, through accumulation
    assert notes == ["parallelism.replicate 4 → 1: it must divide the 1 local data-parallel rank(s)"]
    # 3 data-parallel ranks get 64 sequences each: micro-batch 3 no longer divides them, 2 does
    lay, notes = local(CLUSTER, 6)
    assert (lay.dp, lay.micro_batch, lay.grad_accum) == (3, 2, 32)
    assert any(n.startswith("training.microBatchSize 3 → 2") for n in notes)


@pytest.mark.parametrize("nproc,message", [
    (3, r"--nproc 3: parallelism.tensor × parallelism.pipeline = 2 must divide"),
    (10, r"--nproc 10: the global batch of 192 sequences .* over 5 data-parallel ranks"),
])
def test_kiln_run_refuses_only_what_cannot_run_and_names_the_flag(nproc, message):
    with pytest.raises(KilnError, match=message):
        layout.fit_local(unchecked(CLUSTER), nproc)


def test_expert_parallelism_written_for_the_cluster_falls_back_locally():
    spec = {**CLUSTER, "model": {"preset": "tiny-moe"}, "parallelism": {"expert": 8}}  # cluster: 32 shard ranks
    assert validate_accepts(spec)
    lay, notes = local(spec, 4)  # 4 local shard ranks: the experts spread over 4 of them
    assert (lay.dp_shard, lay.ep) == (4, 4)
    assert notes == ["parallelism.expert 8 → 4: it must divide the 4 local FSDP shard rank(s)"]
    lay, notes = local(spec, 1)  # one process holds every expert
    assert lay.ep == 1 and notes[-1] == "parallelism.expert 8 → 1: it must divide the 1 local FSDP shard rank(s)"


def test_pipeline_microbatches_written_for_the_cluster_fall_back_locally():
    spec = {**CLUSTER, "parallelism": {"pipeline": 2, "pipelineMicrobatches": 12}}  # cluster: 192 / 8 = 24 per rank
    assert validate_accepts(spec)
    lay, notes = local(spec, 2)  # one data-parallel rank with all 192 sequences: 12 splits them
    assert lay.pp_microbatches == 12 and not notes
    lay, notes = local(spec, 64)  # 32 ranks of 6 sequences: 12 cannot split 6, the default (6) does
    assert lay.pp_microbatches == 6
    assert notes == ["parallelism.pipelineMicrobatches 12 → the default: 12 does not split the 6 sequences of "
                     "each local data-parallel rank"]
