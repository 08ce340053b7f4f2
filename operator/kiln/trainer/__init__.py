"""The data plane: what every kiln training process runs (model, parallelism, kernels, loop, guards, metrics)."""
