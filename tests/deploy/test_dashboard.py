"""The Grafana dashboard: valid JSON, generated from docker/grafana/dashboard.py, queries that
Prometheus' grammar accepts, and every topic the deployment promises. (That each queried
metric is really exported is checked against live services in test_stack.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.deploy.conftest import REPO
from tests.deploy.names import metric_names

DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "asyncrl.json"
TOPICS = {  # what the issue asks the dashboard to show → a metric that shows it
    "reward": "asyncrl_critic_rewards_mean",
    "response length": "asyncrl_response_length_mean",
    "weight versions per engine": "asyncrl_engine_weight_version",
    "staleness": "asyncrl_rollouter_staleness_samples",
    "trainer idle ratio": "asyncrl_trainer_idle_ratio",
    "rollouter idle ratio": "asyncrl_rollouter_idle_ratio",
    "sync phases": "asyncrl_sync_phase_seconds",
    "sync GB/s": "asyncrl_sync_last_gb_per_s",
    "samples/s": "asyncrl_rollout_samples_started_total",
    "queue depth": "asyncrl_rollout_queued_samples",
    "consumer lag": "jetstream_consumer_num_pending",
    "engine load": "sglang:num_running_reqs",
    "tool-call latency": "asyncrl_rollout_tool_seconds_total",
    "tool errors": "asyncrl_rollout_tool_errors_total",
    "run health": "asyncrl_rollout_health",
    "engines by state": "asyncrl_rollout_engines",
    "refused syncs": "asyncrl_sync_refused_total",
    "quarantined while current": "asyncrl_rollout_engine_quarantined_current_seconds_total",
    "store sizes": "asyncrl_nats_store_bytes",
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_is_generated_from_its_source():
    proc = subprocess.run([sys.executable, str(REPO / "docker" / "grafana" / "dashboard.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_dashboard_structure(dashboard):
    ds = yaml.safe_load((REPO / "docker" / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
        if p["type"] != "row":
            assert p["datasource"]["uid"] == uid and p["targets"], p["title"]
            assert all(t["datasource"]["uid"] == uid for t in p["targets"])


def test_every_query_parses(deploy_tools, dashboard):
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            assert metric_names(t["expr"]), f"{p['title']}: {t['expr']} selects no metric"


def test_promql_check_is_live(deploy_tools):
    with pytest.raises(ValueError):
        metric_names("rate(asyncrl_rollout_published_total[5m]")


def test_dashboard_shows_every_topic(deploy_tools, dashboard):
    queried = {n for p in dashboard["panels"] for t in p.get("targets", []) for n in metric_names(t["expr"])}
    missing = {topic: name for topic, name in TOPICS.items() if name not in queried}
    assert not missing, missing


@pytest.fixture(scope="module")
def grafana_types():
    from tests.deploy.grafana_schema import schema_dir

    root = schema_dir()
    if isinstance(root, str):
        pytest.skip(root)
    return root


def test_dashboard_satisfies_grafanas_own_dashboard_type(grafana_types, dashboard):
    """Grafana cannot run here; its published types (@grafana/schema, the server's version) can."""
    from tests.deploy.grafana_schema import dashboard_errors

    assert dashboard_errors(grafana_types, dashboard) == []
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][1]["gridPos"]["wdith"] = 3  # a typo Grafana would drop silently
    broken["graphTooltip"] = "shared"
    errors = dashboard_errors(grafana_types, broken, "broken")
    assert any("wdith" in e for e in errors) and any("DashboardCursorSync" in e for e in errors), errors
