"""Generates ``docker/grafana/dashboards/asyncrl.json``, the Grafana dashboard of an asyncrl
deployment (provisioned by ``docker/grafana/provisioning``).

    python docker/grafana/dashboard.py          # rewrite the JSON
    python docker/grafana/dashboard.py --check  # exit 1 if the JSON is out of date

Every query uses metric names the services really export: the rollout service
(``rollout_service/metrics.py``), the sync agent (``sync_agent/metrics.py``), the trainer
(``trainer_daemon/observe/metrics.py``: verl's names, ``/`` → ``_``, prefix ``asyncrl_``), SGLang
(``sglang:*`` with ``--enable-metrics``), prometheus-nats-exporter (``gnatsd_varz_*``,
``jetstream_*``) and the json_exporter module on the sync agent's ``/status``
(``asyncrl_engine_*``). ``tests/deploy/test_stack.py`` scrapes the real services and fails on
a name that none of them exports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).parent / "dashboards" / "asyncrl.json"
DS = {"type": "prometheus", "uid": "asyncrl-prometheus"}
RATE = "[$__rate_interval]"


def target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def panel(title: str, description: str, targets: list[tuple[str, str]], unit: str = "short", *,
          kind: str = "timeseries", w: int = 8, h: int = 8, stack: bool = False, minmax: tuple | None = None) -> dict:
    defaults: dict = {"unit": unit}
    if minmax:
        defaults["min"], defaults["max"] = minmax
    if kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10 if not stack else 40,
                              "showPoints": "never", "stacking": {"mode": "normal" if stack else "none"}}
    return {
        "type": kind, "title": title, "description": description, "datasource": DS,
        "gridPos": {"w": w, "h": h},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
        if kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
        "targets": [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)],
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"w": 24, "h": 1}, "panels": []}


SECTIONS: list[tuple[str, list[dict]]] = [
    ("Health (docs/operations.md)", [
        panel("Run health", "The rollout service's health block: 1 for its current state (progressing, starting, "
              "finished, stalled); /admin/status says why when stalled", [("asyncrl_rollout_health == 1", "{{state}}")],
              w=6, minmax=(0, 1)),
        panel("Engines by state", "healthy, unhealthy (failed health checks), quarantined (sync agent: mixed or behind)",
              [("asyncrl_rollout_engines", "{{state}}")], w=6, stack=True),
        panel("Stall signals", "Seconds since a token was decoded and since a sync succeeded; failed syncs in a row", [
            ("asyncrl_rollout_idle_seconds", "idle (rollout)"), ("asyncrl_sync_seconds_since_success", "since last sync"),
            ("asyncrl_sync_consecutive_failures", "failed syncs in a row")], w=6),
        panel("Refused syncs and wasted capacity", "Sync requests refused per reason (1h; a stale loop shows here) and "
              "engine-seconds per second spent quarantined while already current", [
                  ("sum by (reason) (increase(asyncrl_sync_refused_total[1h]))", "refused {{reason}} (1h)"),
                  (f"rate(asyncrl_rollout_engine_quarantined_current_seconds_total{RATE})", "quarantined at current {{engine}}")],
              w=6),
        panel("NATS stores", "Messages in the run's stream and KV buckets (bounded: docs/operations.md)",
              [("asyncrl_nats_store_messages", "{{store}}")], w=12),
        panel("NATS store bytes", "Bytes in the run's stream and KV buckets",
              [("asyncrl_nats_store_bytes", "{{store}}")], "bytes", w=12),
    ]),
    ("Run", [
        panel("Trainer step", "trainer/global_step of the last update", [("asyncrl_trainer_global_step", "step")],
              kind="stat", w=4, h=4),
        panel("Trainer weight version", "Version the trainer last produced", [("asyncrl_trainer_weight_version", "trainer")],
              kind="stat", w=4, h=4),
        panel("Rollout weight version", "Version the rollout service admits samples at",
              [("asyncrl_rollout_weight_version", "rollout")], kind="stat", w=4, h=4),
        panel("Trajectories published", "Stored by JetStream (exactly once)", [("asyncrl_rollout_published_total", "published")],
              kind="stat", w=4, h=4),
        panel("Trainer idle", "verl trainer/idle_ratio of the last step", [("asyncrl_trainer_idle_ratio", "trainer")],
              "percentunit", kind="stat", w=4, h=4, minmax=(0, 1)),
        panel("Rollouter idle", "verl rollouter/idle_ratio of the last version", [("asyncrl_rollouter_idle_ratio", "rollouter")],
              "percentunit", kind="stat", w=4, h=4, minmax=(0, 1)),
    ]),
    ("Learning", [
        panel("Reward", "critic/rewards/{mean,max,min} of the trajectories of each update", [
            ("asyncrl_critic_rewards_mean", "mean"), ("asyncrl_critic_rewards_max", "max"),
            ("asyncrl_critic_rewards_min", "min")]),
        panel("Response length", "response_length/{mean,max} in tokens (model and tool tokens)", [
            ("asyncrl_response_length_mean", "mean"), ("asyncrl_response_length_max", "max")]),
        panel("Policy", "PPO statistics of the last update", [
            ("asyncrl_actor_pg_clipfrac", "pg_clipfrac"), ("asyncrl_actor_ppo_kl", "ppo_kl"),
            ("asyncrl_actor_entropy", "entropy"), ("asyncrl_actor_grad_norm", "grad_norm")]),
    ]),
    ("Balance: size the rollout:trainer split from these", [
        panel("Idle ratios", "verl's advice: rollouter idle high and trainer idle low → give the trainer more GPUs "
              "(and the engines fewer); trainer idle high and rollouter idle low → the opposite. See docs/deployment.md.", [
                  ("asyncrl_trainer_idle_ratio", "trainer/idle_ratio"), ("asyncrl_rollouter_idle_ratio", "rollouter/idle_ratio")],
              "percentunit", w=12, minmax=(0, 1)),
        panel("Samples per second", "Admitted samples (prompts, each rollout.n trajectories), finished and published "
              "trajectories, trainer tokens/s", [
                  (f"rate(asyncrl_rollout_samples_started_total{RATE})", "samples started/s"),
                  (f"rate(asyncrl_rollout_trajectories_finished_total{RATE})", "trajectories finished/s"),
                  (f"rate(asyncrl_rollout_published_total{RATE})", "trajectories published/s")], "ops", w=12),
    ]),
    ("Weights and staleness", [
        panel("Weight versions", "Trainer, sync agent, rollout service, and every engine (json_exporter on the sync agent's /status)", [
            ("asyncrl_trainer_weight_version", "trainer"), ("asyncrl_sync_weight_version", "sync agent"),
            ("asyncrl_rollout_weight_version", "rollout"), ("asyncrl_engine_weight_version", "engine {{engine}}")]),
        panel("Staleness", "Quota: stale samples carried into this version vs max_required_samples; trainer: stale samples "
              "trained and stale trajectories dropped", [
                  ("asyncrl_rollouter_staleness_samples", "rollouter staleness_samples"),
                  ("asyncrl_rollouter_max_required_samples", "max_required_samples"),
                  ("asyncrl_fully_async_count_stale_samples_processed", "stale samples trained"),
                  ("asyncrl_trainer_dropped_stale_trajectories", "stale trajectories dropped")]),
        panel("Partial rollouts", "fully_async/partial/*: share of samples whose tokens span versions, and the widest span", [
            ("asyncrl_fully_async_partial_partial_ratio", "partial_ratio"),
            ("asyncrl_fully_async_partial_max_partial_span", "max_partial_span")]),
    ]),
    ("Queue", [
        panel("Queue depth and consumer lag", "Finished samples not yet consumed (rollout), the trainer consumer's pending "
              "and unacked messages (trainer and NATS), the outbox waiting for NATS", [
                  ("asyncrl_rollout_queued_samples", "queued samples (rollout)"),
                  ("asyncrl_trainer_consumer_lag", "consumer lag (trainer)"),
                  ("asyncrl_trainer_consumer_ack_pending", "ack pending (trainer)"),
                  ('jetstream_consumer_num_pending{consumer_name="trainer"}', "num_pending (NATS)"),
                  ('jetstream_consumer_num_ack_pending{consumer_name="trainer"}', "num_ack_pending (NATS)"),
                  ("asyncrl_rollout_outbox_trajectories", "outbox")], w=12),
        panel("JetStream", "The run's stream and the server", [
            ("jetstream_stream_total_messages", "{{stream_name}} messages"),
            ("jetstream_stream_total_bytes / 1e6", "{{stream_name}} MB"),
            ("gnatsd_varz_connections", "connections"), ("gnatsd_varz_slow_consumers", "slow consumers")], w=12),
    ]),
    ("Weight sync", [
        panel("Sync phases", "Phase durations of the last finished sync (sync agent)",
              [("asyncrl_sync_phase_seconds", "{{phase}}")], "s", stack=True),
        panel("Sync GB/s", "Achieved GB/s of the last sync's loading phase", [("asyncrl_sync_last_gb_per_s", "GB/s")]),
        panel("Syncs", "Finished syncs by state, and engines waiting for a reload after a failed update", [
            ("sum by (state) (increase(asyncrl_sync_syncs_total[1h]))", "{{state}} (1h)"),
            ("asyncrl_sync_engines_needing_reload", "engines needing reload")]),
    ]),
    ("Engines", [
        panel("Engine load", "Running and queued requests per engine (SGLang), requests in flight per engine (rollout)", [
            ("sglang:num_running_reqs", "running {{instance}}"), ("sglang:num_queue_reqs", "queued {{instance}}"),
            ("asyncrl_rollout_engine_inflight", "in flight {{engine}} ({{state}})")]),
        panel("KV cache and throughput", "SGLang token usage (0-1) and generation throughput (tokens/s)", [
            ("sglang:token_usage", "token usage {{instance}}"), ("sglang:gen_throughput", "tok/s {{instance}}")]),
        panel("Request latency p90", "SGLang end-to-end request latency", [
            (f"histogram_quantile(0.9, sum by (le, instance) (rate(sglang:e2e_request_latency_seconds_bucket{RATE})))",
             "{{instance}}")], "s"),
    ]),
    ("Tools", [
        panel("Tool-call latency", "Mean seconds per tool call", [
            (f"rate(asyncrl_rollout_tool_seconds_total{RATE}) / rate(asyncrl_rollout_tool_calls_total{RATE})", "{{tool}}")], "s"),
        panel("Tool calls and errors", "Calls and error results per second", [
            (f"rate(asyncrl_rollout_tool_calls_total{RATE})", "calls {{tool}}"),
            (f"rate(asyncrl_rollout_tool_errors_total{RATE})", "errors {{tool}}")], "ops"),
        panel("Finish reasons", "Finished trajectories per second by finish reason",
              [(f"sum by (reason) (rate(asyncrl_rollout_finish_reasons_total{RATE}))", "{{reason}}")], "ops", stack=True),
        panel("Infrastructure failures", "Trajectories spoiled by an infrastructure failure (never trained), per second by reason",
              [(f"sum by (reason) (rate(asyncrl_rollout_infra_failures_total{RATE}))", "{{reason}}")], "ops", stack=True),
    ]),
]


def build() -> dict:
    panels, y, pid = [], 0, 1
    for title, items in SECTIONS:
        r = row(title)
        r["id"] = pid
        r["gridPos"].update(x=0, y=y)
        panels.append(r)
        pid, y, x, line_h = pid + 1, y + 1, 0, 0
        for p in items:
            w, h = p["gridPos"]["w"], p["gridPos"]["h"]
            if x + w > 24:
                x, y, line_h = 0, y + line_h, 0
            p["id"] = pid
            p["gridPos"].update(x=x, y=y)
            panels.append(p)
            pid, x, line_h = pid + 1, x + w, max(line_h, h)
        y += line_h
    return {
        "uid": "asyncrl-overview", "title": "asyncrl", "description": "Fully asynchronous RL: rollout, trainer, sync, engines, NATS",
        "tags": ["asyncrl"], "timezone": "browser", "editable": True, "graphTooltip": 1, "refresh": "10s",
        "schemaVersion": 39, "version": 1, "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": []}, "annotations": {"list": []}, "links": [], "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).as_posix()}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
