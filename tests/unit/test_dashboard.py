"""The Grafana dashboard and the monitoring profile (deploy/monitoring, compose.yaml): every PromQL query names
only metrics the API and the worker really export (with their real labels), every SQL query reads only
tables and columns of the ledger schema, and the compose profile mounts files that exist. A renamed metric
or column fails here instead of leaving an empty panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import REGISTRY

import api.metrics  # noqa: F401 - registers the API's metrics in the default registry
from inferq.db import Base
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "inferq.json"
_METRIC = re.compile(r"\binferq_[a-z0-9_]+\b")
_BY = re.compile(r"\bby \(([^)]*)\)")


def _exported() -> dict[str, set[str]]:
    """Every sample name the API and a worker export -> the labels it carries."""
    out: dict[str, set[str]] = {}
    worker = WorkerMetrics(model="m")
    worker.tokens.labels("batch", "completion").inc()  # labelled families export samples once used
    worker.jobs.labels("batch", "succeeded").inc()
    for hist in (worker.queue_time, worker.ttft, worker.tpot, worker.e2e):
        hist.labels("batch").observe(0.1)
    for name in ("queue_depth", "queue_pending", "queue_oldest_age", "queue_backlog"):
        getattr(worker, name).labels("s").set(1)
    worker.seats_busy.labels("batch").set(1)
    api.metrics.REQUESTS.labels("GET", "/x", "200").inc(0)
    api.metrics.SUBMITTED.labels("batch").inc(0)
    api.metrics.REJECTED.labels("quota").inc(0)
    for registry in (worker.registry, REGISTRY):
        for family in registry.collect():
            for sample in family.samples:
                out.setdefault(sample.name, set()).update(sample.labels)
    return out


def _targets() -> list[dict]:
    return [t for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]


def test_every_promql_query_names_exported_metrics_and_labels():
    exported = _exported()
    exprs = [t["expr"] for t in _targets() if "expr" in t]
    assert len(exprs) >= 10
    for expr in exprs:
        names = _METRIC.findall(expr)
        assert names, expr
        for name in names:
            assert name in exported, f"{name} is not exported (query: {expr})"
        labels = set().union(*(exported[n] for n in names))
        for group in _BY.findall(expr):
            for label in (g.strip() for g in group.split(",")):
                assert label == "le" or label in labels, f"label {label!r} not on {names} (query: {expr})"


def test_the_dashboard_has_the_panels_operators_need():
    """Issue 17, item 4: per tier TTFT/TPOT/e2e percentiles, queue backlog and oldest-job age, KV usage and
    prefix hit rate, tokens and cost per tenant (a panel for each, found by what its queries read)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]

    def panel_reading(*needles: str) -> list[str]:
        return [p["title"] for p in panels
                if all(any(n in (t.get("expr") or t.get("rawSql") or "") for t in p["targets"]) for n in needles)]

    for hist in ("inferq_time_to_first_token_seconds", "inferq_time_per_output_token_seconds", "inferq_e2e_seconds"):
        assert panel_reading(f"histogram_quantile(0.5, sum by (le, tier) (rate({hist}_bucket"), hist
        assert panel_reading(f"histogram_quantile(0.95, sum by (le, tier) (rate({hist}_bucket"), hist
    assert panel_reading("inferq_queue_backlog", "inferq_queue_pending")
    assert panel_reading("inferq_queue_oldest_age_seconds")
    assert panel_reading("inferq_kv_cache_usage_ratio", "inferq_prefix_cache_hit_rate")
    assert panel_reading("inferq_engine_seats_busy")
    assert panel_reading("cost_micros", "t.name")  # cost per tenant, from the ledger
    assert panel_reading("completion_tokens", "t.name")  # tokens per tenant


def test_every_sql_query_reads_real_tables_and_columns():
    sqls = [t["rawSql"] for t in _targets() if "rawSql" in t]
    assert sqls
    tables = Base.metadata.tables
    for sql in sqls:
        aliases = dict(re.findall(r"\b(?:FROM|JOIN)\s+(\w+)\s+(\w+)", sql))
        assert aliases, sql
        for alias, table in ((a, t) for t, a in aliases.items()):
            assert table in tables, f"no table {table}"
            for column in re.findall(rf"\b{alias}\.(\w+)", sql):
                assert column in tables[table].c, f"no column {table}.{column}"


def test_monitoring_profile_mounts_files_that_exist():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = {name: svc for name, svc in compose["services"].items() if "monitoring" in svc.get("profiles", [])}
    assert set(services) == {"prometheus", "grafana"}
    for svc in services.values():
        for volume in svc["volumes"]:
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), source
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"api:8000", "worker:9100"}  # the API's port and the worker's --metrics-port
    assert "--metrics-port" in compose["services"]["worker"]["command"]
