"""Parallelisms applied to a plain nn.Module on one DeviceMesh: FSDP2, tensor, pipeline, compile, gradient compression."""
