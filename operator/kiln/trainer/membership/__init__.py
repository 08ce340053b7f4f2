"""Who takes part in a step: replica groups on torchft (per-step fault tolerance) and their hang watch."""
