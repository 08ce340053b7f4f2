"""Prometheus metrics of a training run, on http://:<port>/metrics of rank 0.

The loop hands `TrainerExporter.observe` the same per-step record it logs (kiln.trainer.observe.metrics); the
exporter keeps the latest values. Keys it reads, all optional per record:

    step, loss, tokens_per_second, mfu, step_s, tokens_seen   every logged step
    checkpoint_stall_s   seconds this step blocked on a checkpoint (staging, or a synchronous save)
    data_mix             {source uri: realised share of the samples consumed} when data.sources mixes datasets
    guard_rollbacks, guard_skipped_spike, guard_skipped_nonfinite   the stability guards' counters so far
    steps_since_commit, checkpoint_interval_steps   how stale the newest commit is, in steps
    sdc_checks, sdc_mismatches   the silent-data-corruption check's counts (kiln.trainer.guards), every step
    moe_balance, moe_load_cv, moe_busiest_tokens, moe_idlest_tokens, moe_aux_loss, moe_z_loss   a mixture of
                 experts' router over the step (kiln.trainer.model.moe.RouterLoad), every logged step
    gpu_health   every node's GPU states (kiln.trainer.observe.gpu_health, gathered by rank 0) → kiln_gpu_health{node,gpu}:
                 0 Healthy, 1 Degrading, 2 Failing, -1 Unknown (kiln.api.contract.GPU_HEALTH_GAUGE); a
                 node where the run uses no GPU (NotApplicable) has no series
    rank_own_s, rank_wait_s, rank_nodes, stragglers   each rank's step-time split every resources.stragglers.everySteps
                 (kiln.trainer.observe.stragglers) → kiln_train_rank_own_seconds / kiln_train_rank_wait_seconds
                 {rank,node}, and kiln_train_straggler{rank,node} = 1 for each rank named (no series otherwise)
"""

from __future__ import annotations

import math
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kiln.api import contract

DEFAULT_PORT = 9400  # where the trainer pods' metrics live unless KILN_METRICS_PORT says otherwise

# Record key -> gauge (name, help). One place to add a metric shown on the dashboard.
GAUGES = {
    "step": ("kiln_train_step", "Last completed optimizer step."),
    "loss": ("kiln_train_loss", "Training loss of the last logged step."),
    "tokens_per_second": ("kiln_train_tokens_per_second", "Training throughput over all ranks, tokens/s."),
    "mfu": ("kiln_train_mfu", "Model FLOPs utilisation of the last logged step (0..1)."),
    "tokens_seen": ("kiln_train_tokens_seen", "Tokens trained on since the start of the run."),
    "guard_rollbacks": ("kiln_train_guard_rollbacks", "Loss-spike rollbacks to the last good commit so far."),
    "guard_skipped_spike": ("kiln_train_guard_skipped_spike_steps", "Updates skipped as loss spikes so far."),
    "guard_skipped_nonfinite": ("kiln_train_guard_skipped_nonfinite_steps", "Updates skipped for a NaN/Inf loss "
                                "or gradient so far."),
    "steps_since_commit": ("kiln_train_steps_since_commit", "Steps trained since the newest committed checkpoint."),
    "checkpoint_interval_steps": ("kiln_train_checkpoint_interval_steps", "The checkpoint interval in steps (for "
                                  "intervalSteps: auto, its current choice)."),
    "sdc_checks": ("kiln_train_sdc_checks", "Silent-data-corruption checks that compared something, in this "
                   "process."),
    "sdc_mismatches": ("kiln_train_sdc_mismatches", "Silent-data-corruption mismatches this run met, across its "
                       "restarts (each one is an object under incidents/sdc/ of the checkpoint URI)."),
    "moe_balance": ("kiln_train_moe_balance", "Mixture of experts: the busiest expert's routed tokens over the mean, "
                    "in the most unbalanced MoE layer, over the last logged step (1: balanced)."),
    "moe_load_cv": ("kiln_train_moe_load_cv", "Mixture of experts: coefficient of variation of the experts' routed "
                    "tokens, mean over MoE layers, last logged step (0: balanced)."),
    "moe_busiest_tokens": ("kiln_train_moe_busiest_expert_tokens", "Mixture of experts: tokens routed to the "
                           "busiest expert of any MoE layer in the last logged step, on this rank's batch share."),
    "moe_idlest_tokens": ("kiln_train_moe_idlest_expert_tokens", "Mixture of experts: tokens routed to the idlest "
                          "expert of any MoE layer in the last logged step, on this rank's batch share."),
    "moe_aux_loss": ("kiln_train_moe_aux_loss", "Mixture of experts: the load-balancing loss (unweighted; 1 when "
                     "balanced), mean over the last logged step's microbatches."),
    "moe_z_loss": ("kiln_train_moe_z_loss", "Mixture of experts: the router z-loss (unweighted), mean over the "
                   "last logged step's microbatches."),
}
# A run's goodput and restarts are the operator's (it sees the time no trainer runs): kiln.control.metrics.
STEP_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class TrainerExporter:
    """The latest training metrics of one run, labelled `run`, in a registry of its own."""

    def __init__(self, run: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self._run = run
        # Labelled children are made on first use: a metric the loop never reports is absent, not a fake 0.
        self._gauges = {key: Gauge(name, doc, ["run"], registry=self.registry) for key, (name, doc) in GAUGES.items()}
        self._step_seconds = Histogram(
            "kiln_train_step_seconds", "Wall time of one optimizer step.", ["run"],
            buckets=STEP_SECONDS_BUCKETS, registry=self.registry,
        ).labels(run)
        self._stall = Counter(
            "kiln_train_checkpoint_stall_seconds", "Seconds training blocked on checkpoints.", ["run"],
            registry=self.registry,
        ).labels(run)
        self._mix = Gauge("kiln_data_source_share", "Realised share of each data.sources entry in the samples "
                          "consumed so far (0..1).", ["run", "source"], registry=self.registry)
        self._gpu_health = Gauge("kiln_gpu_health", "GPU health as NVML shows it: 0 healthy, 1 degrading, "
                                 "2 failing, -1 unknown (a GPU node whose NVML cannot be read).",
                                 ["run", "node", "gpu"], registry=self.registry)
        self._gpu_series: set[tuple[str, str, str]] = set()
        self._split = {key: Gauge(name, doc, ["run", "rank", "node"], registry=self.registry) for key, name, doc in (
            ("rank_own_s", "kiln_train_rank_own_seconds", "A rank's own seconds per step (data and compute, not "
             "waiting in collectives), averaged over the last report's steps."),
            ("rank_wait_s", "kiln_train_rank_wait_seconds", "A rank's seconds per step waiting (in collectives), "
             "averaged over the last report's steps."))}
        self._straggler = Gauge("kiln_train_straggler", "1 for a rank named a straggler: its own step time above "
                                "resources.stragglers.factor x the others' median for window reports.",
                                ["run", "rank", "node"], registry=self.registry)
        self._straggler_series: set[tuple[str, str, str]] = set()
        self._server = None

    def observe(self, record: dict) -> None:
        """Take one step's record; keys that are missing or not numbers are left as they were."""
        for key, gauge in self._gauges.items():
            value = _number(record.get(key))
            if value is not None:
                gauge.labels(self._run).set(value)
        step_s = _number(record.get("step_s"))
        if step_s is not None and math.isfinite(step_s) and step_s >= 0:
            self._step_seconds.observe(step_s)
        for source, share in (record.get("data_mix") or {}).items():
            if _number(share) is not None:
                self._mix.labels(self._run, str(source)).set(share)
        if record.get("gpu_health") is not None:
            self._observe_gpu_health(record["gpu_health"])
        if record.get("stragglers") is not None:
            self._observe_split(record)
        stall = _number(record.get("checkpoint_stall_s"))
        if stall is not None and math.isfinite(stall) and stall > 0:
            self._stall.inc(stall)

    def _observe_gpu_health(self, entries: list[dict]) -> None:
        """One series per GPU of every node the run is on now; a node it left loses its series."""
        series = {}
        for entry in entries:
            for gpu in entry.get("gpus") or []:
                code = contract.GPU_HEALTH_GAUGE.get(gpu.get("state"))
                if code is not None:
                    series[(self._run, str(entry["node"]), str(gpu["index"]))] = code
        for gone in self._gpu_series - set(series):
            self._gpu_health.remove(*gone)
        for labels, code in series.items():
            self._gpu_health.labels(*labels).set(code)
        self._gpu_series = set(series)

    def _observe_split(self, record: dict) -> None:
        """Each rank's own and waiting seconds; a straggler series for each rank named, removed once it is not."""
        nodes = record.get("rank_nodes") or []
        for key, gauge in self._split.items():
            for rank, value in enumerate(record.get(key) or []):
                if _number(value) is not None and rank < len(nodes):
                    gauge.labels(self._run, str(rank), str(nodes[rank])).set(value)
        named = {(self._run, str(e["rank"]), str(e["node"])) for e in record["stragglers"]}
        for gone in self._straggler_series - named:
            self._straggler.remove(*gone)
        for labels in named:
            self._straggler.labels(*labels).set(1)
        self._straggler_series = named

    def start(self, port: int | None = None, addr: str = "0.0.0.0") -> int:
        """Serve /metrics from a daemon thread; port 0 picks a free one. Returns the port served."""
        if port is None:
            port = int(os.environ.get(contract.METRICS_PORT, DEFAULT_PORT))
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _number(value) -> float | None:
    # bool is an int subclass; a flag is not a metric.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
