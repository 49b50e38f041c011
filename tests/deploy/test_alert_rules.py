"""docker/prometheus/alerts.yml: loaded by prometheus.yml, mounted by compose.yaml, every rule
well formed and its expression accepted by Prometheus' grammar. (That every metric a rule
uses is really exported is checked against live services in test_stack.py.)"""

from __future__ import annotations

import re

import yaml

from tests.deploy.conftest import REPO
from tests.deploy.names import metric_names

PROM = REPO / "docker" / "prometheus"
DURATION = re.compile(r"^\d+[smhd]$")


def test_rules_are_loaded_and_mounted():
    prom = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert prom["rule_files"] == ["/etc/prometheus/alerts.yml"]
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    mounts = compose["services"]["prometheus"]["volumes"]
    assert {"type": "bind", "source": "./docker/prometheus/alerts.yml", "target": "/etc/prometheus/alerts.yml",
            "read_only": True} in mounts


def test_every_rule_is_well_formed():
    rules = [r for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)) and len(rules) >= 8
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
        assert r["labels"]["severity"] in ("warning", "critical"), r
        assert r["annotations"]["summary"], r
        assert "for" not in r or DURATION.match(r["for"]), r
        used = metric_names(r["expr"])  # raises on an expression Prometheus would refuse
        assert used and all(n.startswith("asyncrl_") for n in used), (r["alert"], used)


def test_the_stall_and_consumer_alerts_exist():
    exprs = {r["alert"]: r["expr"] for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    assert metric_names(exprs["RunStalled"]) == {"asyncrl_rollout_health"}
    assert metric_names(exprs["ConsumerAtMaxAckPending"]) == {"asyncrl_trainer_consumer_ack_pending",
                                                              "asyncrl_trainer_consumer_max_ack_pending"}
