"""cluster/: every `ray up` YAML passes Ray's own schema; KubeRay manifests carry what they must."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
RAY_UP = ["aws-gpu.yaml", "gcp-gpu.yaml", "local-fake.yaml"]


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CLUSTER / name).read_text())


def validate(config: dict[str, Any]) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    if config["provider"]["type"] == "fake_multinode":
        validate_config(config)  # complete as written: its defaults file is not in the wheel
    else:
        validate_config(prepare_config(copy.deepcopy(config)))


def test_every_ray_up_yaml_is_listed() -> None:
    launcher = {p.name for p in CLUSTER.glob("*.yaml") if not p.name.startswith("kuberay")}
    assert launcher == set(RAY_UP)


@pytest.mark.parametrize("name", RAY_UP)
def test_cluster_yaml_passes_rays_schema(name: str) -> None:
    validate(load(name))


def test_the_schema_check_catches_a_broken_yaml() -> None:
    import jsonschema

    broken = load("aws-gpu.yaml")
    broken["available_node_types"]["gpu_a10g"]["max_wokers"] = 8
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


@pytest.mark.parametrize("name", ["aws-gpu.yaml", "gcp-gpu.yaml"])
def test_cloud_clusters_autoscale_gpus_securely(name: str) -> None:
    cfg = load(name)
    assert (
        cfg["docker"]["image"].startswith("rayproject/ray:2.60.0")
        and "gpu" in cfg["docker"]["image"]
    )
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    gpu = [t for n, t in cfg["available_node_types"].items() if t["resources"].get("GPU")]
    assert len(gpu) >= 2 and all(t["min_workers"] == 0 and t["max_workers"] > 0 for t in gpu)
    assert any(t["resources"].get("spot") for t in gpu)  # the spot/preemptible variant
    assert cfg["idle_timeout_minutes"] > 0
    start = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in start and "RAY_AUTH_MODE=token" in start
    assert all("RAY_AUTH_MODE=token" in c for c in cfg["worker_start_ray_commands"] if "start" in c)
    assert "token" not in yaml.safe_dump(cfg["setup_commands"]).lower()  # no secret in the YAML


def gpu_group(spec: dict[str, Any]) -> dict[str, Any]:
    (group,) = spec["workerGroupSpecs"]
    return group


def test_kuberay_raycluster_autoscales_gpu_workers_with_token_auth() -> None:
    doc = load("kuberay-raycluster.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    spec = doc["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["authOptions"] == {"mode": "token"} and spec["rayVersion"] == "2.60.0"
    group = gpu_group(spec)
    assert group["minReplicas"] == 0 < group["maxReplicas"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_kuberay_rayjob_runs_raylift_train() -> None:
    doc = load("kuberay-rayjob.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    spec = doc["spec"]
    assert spec["entrypoint"].startswith("raylift train ")
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"} and cluster["enableInTreeAutoscaling"]
    assert gpu_group(cluster)["maxReplicas"] > 0
