"""spec.checkpoint: where and how often the run checkpoints."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kiln.api.base import ApiModel
from kiln.api.spec.limits import JSON_INT_MAX


class CheckpointSpec(ApiModel):
    """Where and how often to checkpoint; any world size can resume from a checkpoint."""

    uri: str | None = Field(
        None, max_length=1024,
        description="s3://bucket/prefix/ or file:///path/. Default for `kiln run`: file://<output>/checkpoints/; "
        "an s3:// uri without endpoint is AWS S3, and without credentialsSecret uses the pods' own AWS identity.",
    )
    endpoint: str | None = Field(
        None, max_length=1024,
        description="S3 endpoint URL, e.g. http://minio.minio.svc:9000; unset: AWS S3 (https://s3.amazonaws.com).",
    )
    credentials_secret: str | None = Field(
        None, max_length=253,
        description="Name of a Secret in the run's namespace with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; "
        "the pods read it by reference, keys are never inline. Unset: the pods' own AWS identity (EKS Pod "
        "Identity on the run's ServiceAccount <name>-trainer, ECS, the node's instance role).",
    )
    interval_steps: Annotated[int, Field(le=JSON_INT_MAX)] | Literal["auto"] = Field(
        100,
        description="Save every N steps (N >= 1), or 'auto' (Young/Daly from the measured save cost and failure rate).",
    )
    keep: int = Field(3, ge=1, le=JSON_INT_MAX, description="Committed checkpoints to keep; the newest is never deleted.")
    async_save: bool = Field(True, description="Upload in the background; training blocks only to stage state.")
