"""The Kubernetes manifests (deploy/k8s): every built-in object is valid against the Kubernetes API schema
(``kubernetes-validate``, offline, strict: an unknown field fails), and the parts no schema can judge match
the service: the KEDA ScaledObject scales on the backlog metric the workers really export, scales
the worker Deployment, and the worker's termination grace period covers its drain on SIGTERM."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from inferq.contract import model_id
from inferq.settings import Settings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"


def _objects() -> list[dict]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def _by_kind(kind: str) -> list[dict]:
    return [o for o in _objects() if o["kind"] == kind]


@pytest.mark.parametrize("obj", [o for o in _objects() if "keda.sh" not in o["apiVersion"]],
                         ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_builtin_objects_are_valid_kubernetes(obj):
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises with the field and reason


def test_every_inferq_command_and_setting_exists():
    config = _by_kind("ConfigMap")[0]["data"]
    fields = {f"INFERQ_{name.upper()}" for name in Settings.model_fields}
    assert set(config) <= fields, set(config) - fields
    commands = {c["args"][0] for kind in ("Deployment", "Job") for o in _by_kind(kind)
                for c in o["spec"]["template"]["spec"]["containers"]}
    assert commands == {"api", "worker", "celery-worker", "migrate"}


def test_scaledobject_scales_on_the_backlog_the_workers_export():
    """The query's metric and model label are the ones a worker of the configured model exports."""
    from prometheus_client import generate_latest

    from worker.metrics import WorkerMetrics

    config = _by_kind("ConfigMap")[0]["data"]
    (scaled,) = _by_kind("ScaledObject")
    workers = [d for d in _by_kind("Deployment") if d["metadata"]["name"] == scaled["spec"]["scaleTargetRef"]["name"]]
    assert workers and workers[0]["spec"]["template"]["spec"]["containers"][0]["args"][0] == "worker"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    query = trigger["metadata"]["query"]
    model = model_id(config["INFERQ_MODEL"])
    assert f'inferq_queue_depth{{model="{model}"}}' in query
    metrics = WorkerMetrics(model=model)
    metrics.queue_depth.labels("inferq:jobs:x:interactive").set(3)
    exported = generate_latest(metrics.registry).decode()
    assert f'inferq_queue_depth{{model="{model}",stream="inferq:jobs:x:interactive"}} 3.0' in exported
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_worker_grace_period_covers_its_drain():
    grace = float(_by_kind("ConfigMap")[0]["data"]["INFERQ_SHUTDOWN_GRACE_SECONDS"])
    worker = next(d for d in _by_kind("Deployment") if d["metadata"]["name"] == "inferq-worker")
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace + 10
