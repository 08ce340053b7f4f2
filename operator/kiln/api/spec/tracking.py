"""spec.tracking: experiment tracking in MLflow and/or Weights & Biases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.api.base import ApiModel


class MlflowTracking(ApiModel):
    """An MLflow tracking server that trainer rank 0 logs the run to."""

    uri: str = Field(
        ..., min_length=1, max_length=1024, pattern=r"^(https?|file)://",
        description="Tracking server URI, e.g. http://mlflow.mlflow.svc:5000 (file:// for a local folder with "
        "kiln run).",
    )
    experiment: str | None = Field(
        None, min_length=1, max_length=256,
        description="Experiment name (created if missing). Default: <namespace>/<name> of the TrainingSpec.",
    )
    credentials_secret: str | None = Field(
        None, max_length=253,
        description="Secret in the run's namespace with MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (each optional); read by reference, never inline.",
    )


class WandbTracking(ApiModel):
    """A Weights & Biases project that trainer rank 0 logs the run to."""

    project: str = Field(..., min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, max_length=128, description="W&B entity (team or user); default: the key's.")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: send as it trains; offline: write the run's folder (under the output "
        "directory) for a later `wandb sync`.",
    )
    credentials_secret: str | None = Field(
        None, max_length=253,
        description="Secret in the run's namespace with WANDB_API_KEY; read by reference, never inline.",
    )


class TrackingSpec(ApiModel):
    """Experiment tracking: parameters once, every logged step's metrics, checkpoint commits. A restarted run
    continues the same tracked run; a tracker that is down or slow never blocks or fails a step."""

    mlflow: MlflowTracking | None = Field(None, description="Log to an MLflow tracking server.")
    wandb: WandbTracking | None = Field(None, description="Log to Weights & Biases.")
    buffer: int = Field(
        10_000, ge=1, le=1_000_000,
        description="Records held while a tracker is slow or down; beyond it a record is dropped and counted "
        "(tracking_dropped in metrics.jsonl).",
    )
