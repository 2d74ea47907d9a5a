"""Names several layers share: the MLflow URI forms that ``model.weights`` may take, and
the logged model's name and note. Here so that the modules reading them need not import
the one that writes them."""

from __future__ import annotations

VERSION = "0.1.0"  # raylift.__version__, as pyproject.toml states it

MLFLOW_MODEL_URIS = ("models:/", "runs:/")  # model.weights read through MLflow

MODEL_NAME = "model"  # the logged model's name: runs:/RUN_ID/model resolves it

NOTE = "raylift-model.json"  # what the folder holds and where it came from


def is_mlflow_uri(path: str | None) -> bool:
    return bool(path) and str(path).startswith(MLFLOW_MODEL_URIS)
