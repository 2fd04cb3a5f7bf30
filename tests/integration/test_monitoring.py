"""deploy/monitoring/ (the Grafana dashboard, the Prometheus alert rules) against what the components export.

The live test fails when any PromQL expression of either file references a kvdir_* metric that no
running component exports on /metrics, or matches or groups by a label its series do not carry, on a
cluster that has served no request: a renamed metric must not leave a panel showing "No data" or an
alert that can never fire, and neither may a labelled counter that has no series until its first event
(each is created with its known label values at zero). promtool is not installed here, so PromQL
syntax is only checked for balanced brackets.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adapters.config import EventsSettings
from adapters.connector_metrics import ConnectorMetrics
from adapters.subscriber import Adapter

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
RULES = MONITORING / "kvdir-alerts.yml"
DASHBOARD = MONITORING / "kvdir-dashboard.json"
METRIC = re.compile(r"kvdir_[a-z0-9_]+")
SELECTOR = re.compile(r"(kvdir_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"')
GROUPED = re.compile(r"by\s*\(([\w\s,]*)\)\s*\([^{}]*?(kvdir_[a-z0-9_]+)")  # `by (labels) (...metric...)`
SCRAPE_LABELS = {"job", "instance", "shard", "le"}  # added by Prometheus' scrape config, or a histogram's own
# The series a family exposes, by type (prometheus_client's parser strips a counter's `_total` from its family name).
SERIES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
EXPORTER = {
    "kvdir_directory_": "directory",
    "kvdir_gateway_": "gateway",
    "kvdir_worker_": "worker",
    "kvdir_connector_": "connector",
    "kvdir_events_": "events",
}


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def _queries() -> dict[str, str]:
    """Every PromQL expression of both files, by where it is."""
    out = {f"alert {r['alert']}": r["expr"] for r in _rules()}
    for p in _panels():
        out |= {f"panel {p['title']!r} {t['refId']}": t["expr"] for t in p["targets"]}
    return out


def _exported(text: str) -> dict[str, set[str] | None]:
    """Series names a /metrics text exposes, each with the label names its samples carry (None: no sample yet)."""
    out: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SERIES.get(family.type, ("",)):
            out.setdefault(family.name + suffix, None)
        for sample in family.samples:
            out[sample.name] = (out.get(sample.name) or set()) | set(sample.labels)
    return out


def _problems(queries: dict[str, str], exported: dict[str, dict[str, set[str] | None]]) -> list[str]:
    """What in `queries` no component in `exported` (component -> its series) backs."""
    problems = []
    for where, expr in queries.items():
        for name in METRIC.findall(expr):
            component = next((c for prefix, c in EXPORTER.items() if name.startswith(prefix)), None)
            if component is None or name not in exported[component]:
                problems.append(f"{where}: {name} is not on the {component or 'unknown component'}'s /metrics")
        used = [(name, MATCHER.findall(matchers)) for name, matchers in SELECTOR.findall(expr)]
        used += [(name, [g.strip() for g in groups.split(",") if g.strip()]) for groups, name in GROUPED.findall(expr)]
        for name, wanted in used:
            wanted = [label for label in wanted if label not in SCRAPE_LABELS]
            if not wanted:
                continue
            labels = next((e[name] for e in exported.values() if e.get(name) is not None), None)  # only samples show labels
            if labels is None:
                problems.append(f"{where}: {name} has no series before its first event: create its labels at zero")
                continue
            for label in wanted:
                if label not in labels:
                    problems.append(f"{where}: {name} has no label {label!r} (it has {sorted(labels)})")
    return problems


def test_alert_rules_have_what_alertmanager_and_the_docs_need() -> None:
    rules = _rules()
    assert len({r["alert"] for r in rules}) == len(rules), "alert names are unique"
    for r in rules:
        assert {"alert", "expr", "for", "labels", "annotations"} <= r.keys(), r.get("alert")
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]


def test_dashboard_panels_query_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for p in _panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"] and t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        assert p["description"] and p["gridPos"]["w"] > 0, p["title"]


def test_every_expression_has_balanced_brackets() -> None:
    pairs = {")": "(", "]": "[", "}": "{"}
    for where, expr in _queries().items():
        stack: list[str] = []
        for ch in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):  # brackets inside label values do not count
            if ch in "([{":
                stack.append(ch)
            elif ch in pairs:
                assert stack and stack.pop() == pairs[ch], f"{where}: unbalanced {ch!r} in {expr}"
        assert not stack, f"{where}: unclosed {stack} in {expr}"


def test_prometheus_config_loads_the_rules_and_names_jobs_as_the_rules_expect() -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert config["rule_files"] == [RULES.name]
    assert all(job["job_name"].startswith("kvdir-") for job in config["scrape_configs"])  # KvdirTargetDown's up{job=~"kvdir-.*"}


def test_every_metric_queried_is_on_a_live_metrics_page(make_cluster, make_workers, make_gateway) -> None:
    """A real replica, worker and gateway that have served no request: every kvdir_* name and label in both
    files must be on its component's /metrics, labelled series included (at zero)."""
    c = make_cluster(1)
    w = make_workers(c, 1)
    g = make_gateway(c, 1)
    urls = {"directory": c.replica_urls[0], "worker": w.urls[0], "gateway": g.url}
    exported = {name: _exported(httpx.get(url + "/metrics", timeout=10).text) for name, url in urls.items()}
    # The vLLM connector's and the events adapter's registries, as their metrics servers serve them (the connector
    # runs inside vLLM: make test-vllm scrapes it live).
    exported["connector"] = _exported(generate_latest(ConnectorMetrics(tp_size=2).registry).decode())
    exported["events"] = _exported(generate_latest(Adapter(EventsSettings(node_id="e")).registry).decode())
    queries = _queries()
    assert len(queries) > 40
    assert _problems(queries, exported) == []
    # The check itself catches an unknown name and an unknown label.
    assert len(_problems({"bogus": 'rate(kvdir_gateway_bogus_total[5m]) + kvdir_worker_running{nope="x"}'}, exported)) == 2
    unlabelled = {"worker": {"kvdir_worker_requests_total": None}, "directory": {}, "gateway": {}, "connector": {}, "events": {}}
    assert _problems({"grouped": "sum by (endpoint) (rate(kvdir_worker_requests_total[5m]))"}, unlabelled) == [
        "grouped: kvdir_worker_requests_total has no series before its first event: create its labels at zero"
    ]
