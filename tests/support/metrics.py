"""What kiln exports to Prometheus: every sample name the operator and a trainer export, after one observation of
each kind (the dashboard and the alert rules may query only these)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kiln.control import metrics as op
from kiln.trainer.observe.exporter import GAUGES, TrainerExporter


def exported_names() -> set[str]:
    """Every sample name the operator and a trainer export (after one observation of each kind)."""
    trainer = TrainerExporter("dash", registry=CollectorRegistry())
    trainer.observe({key: 1.0 for key in GAUGES} | {"step_s": 1.0, "checkpoint_stall_s": 1.0,
                                                    "data_mix": {"s3://d/web/": 0.7, "s3://d/code/": 0.3},
                                                    "gpu_health": [{"node": "n1", "gpus": [{"index": 0,
                                                                                            "state": "Healthy"}]}],
                                                    "rank_own_s": [0.1], "rank_wait_s": [0.0], "rank_nodes": ["n1"],
                                                    "stragglers": [{"rank": 0, "node": "n1"}]})
    with op.reconcile("t-dash"):
        op.observe_status("t-dash", "x", {"phase": "Running", "goodput": 0.9, "restarts": 1,
                                          "cost": {"gpuHoursByCause": {"productive": 1.0},
                                                   "amountByCause": {"productive": 3.5}},
                                          "scaling": {"phases": [{"nodes": 1, "efficiency": 1.0}]}})
    names = set()
    for registry in (op.REGISTRY, trainer.registry):
        names |= {s.name for family in registry.collect() for s in family.samples}
    op.forget("t-dash", "x")
    return names
