"""Asynchronous, atomic checkpoints any world size can resume: schedule, save, restore, preemption, the DCP store, the host-memory copy."""
