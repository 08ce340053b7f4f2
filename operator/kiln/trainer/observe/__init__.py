"""What a run shows: metrics, the status report, the Prometheus exporter, GPU health, start-up time."""
