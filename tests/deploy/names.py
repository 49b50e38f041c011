"""Metric names: those a /metrics page exports, those a PromQL query selects (Prometheus'
grammar via promql_parser), those the json_exporter module produces."""

from __future__ import annotations

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.conftest import REPO


def exported_series(text: str) -> set[str]:
    """Every series name a /metrics page can be queried by, also for families with no sample yet."""
    out: set[str] = set()
    for fam in text_string_to_metric_families(text):
        out |= {s.name for s in fam.samples}
        if fam.type == "counter":
            out |= {fam.name + "_total"}
        elif fam.type in ("gauge", "untyped", "unknown"):
            out.add(fam.name)
        elif fam.type == "histogram":
            out |= {fam.name + sfx for sfx in ("_bucket", "_sum", "_count")}
    return out


def metric_names(expr: str) -> set[str]:
    import promql_parser

    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            names.add(name)

    promql_parser.walk(promql_parser.parse(expr.replace("$__rate_interval", "1m")), visit)
    return names


def json_exporter_series() -> set[str]:
    cfg = yaml.safe_load((REPO / "docker" / "json-exporter" / "config.yml").read_text())
    out = set()
    for module in cfg["modules"].values():
        for m in module["metrics"]:
            out |= {f"{m['name']}_{k}" for k in m.get("values", {})} if m.get("type") == "object" else {m["name"]}
    return out
