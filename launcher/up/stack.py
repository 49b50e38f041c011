"""Starting the whole run as child processes, and watching them.

``Stack.start`` brings up, in order, each one ready before the next: the embedded NATS
(unless ``nats.url``), the local engines (unless ``engines.urls``), the rollout service, the
sync agent and the trainer (torchrun). Ports are free loopback ports; tokens are generated
when the config has none. The resolved config (ports, URLs, tokens) is written to
``<run dir>/config.yaml`` (mode 600: it holds the tokens) and every child reads it, so
every process agrees on one document. Logs go to ``<run dir>/logs/<child>.log``.

``Stack.poll`` reports a child that exited; ``Stack.stop`` stops everything in reverse order
(SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from asyncrl.config import RunConfig, revealed_document, secret
from asyncrl.jetstream import EmbeddedNats, write_endpoint
from asyncrl.launch import ChildProcess, http_ok
from asyncrl.listen_ports import distinct_free_ports
from launcher.config_cli import resolved_document

ENGINE_READY_S = 240.0  # model load; builtin:smollm2-135m converts a GGUF on first use
SERVICE_READY_S = 120.0  # rollout service: tokenizer, dataset, NATS stream; sync agent: instant


def _secret(cfg_value) -> str:
    return cfg_value.get_secret_value() if cfg_value is not None else "asyncrl-" + secrets.token_urlsafe(18)


@dataclass
class Stack:
    cfg: RunConfig
    run_dir: Path
    children: dict[str, ChildProcess] = field(default_factory=dict)
    nats: EmbeddedNats | None = None
    resolved_path: Path | None = None
    urls: dict[str, str] = field(default_factory=dict)

    def _child(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ChildProcess:
        proc = ChildProcess(name, argv, self.run_dir / "logs" / f"{name}.log", env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.children[name] = proc
        return proc.start()

    def resolve(self) -> RunConfig:
        """Fill in what the processes need to find each other (ports, URLs) and the secrets they
        share: tokens, an engine key for the engines it starts, a NATS user and password for
        its embedded NATS (generated when not configured)."""
        cfg = self.cfg
        doc = revealed_document(cfg)  # every configured secret in clear (never the masked display value)
        sec = cfg.security
        doc["security"].update(admin_token=_secret(sec.admin_token), sync_token=_secret(sec.sync_token),
                               api_token=_secret(sec.api_token))
        # nothing runs open (issue 30): engines this stack starts get a key, its embedded NATS a user
        starts_engines = cfg.engines.backend == "local" and not cfg.engines.urls
        if cfg.engines.api_key is not None or starts_engines:
            doc["engines"]["api_key"] = _secret(cfg.engines.api_key)
        if not cfg.nats.url:
            doc["nats"]["user"] = cfg.nats.user or "asyncrl"
            doc["security"]["nats_password"] = _secret(sec.nats_password)
        # the stack's free ports in one draw, so no two services get the same one
        spare = iter(distinct_free_ports(3 + (cfg.engines.num_local if starts_engines else 0)))
        doc["rollout"]["port"] = cfg.rollout.port or next(spare)
        doc["sync"]["port"] = cfg.sync.port or next(spare)
        doc["sync"]["url"] = f"http://127.0.0.1:{doc['sync']['port']}"
        doc["sync"]["rollout_url"] = f"http://127.0.0.1:{doc['rollout']['port']}"
        doc["trainer"]["metrics_port"] = cfg.trainer.metrics_port or next(spare)
        self.engine_ports = list(spare)
        doc["run"]["dir"] = str(self.run_dir)
        self.doc = doc
        return RunConfig.model_validate(doc)

    def write_config(self, cfg: RunConfig) -> Path:
        path = self.run_dir / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(self.doc, f, sort_keys=False)
        (self.run_dir / "config.resolved.yaml").write_text(yaml.safe_dump(resolved_document(cfg), sort_keys=False))
        self.resolved_path = path
        return path

    def start(self, progress=print, training: bool = True) -> RunConfig:
        """Start NATS (unless ``nats.url``), local engines (unless ``engines.urls``), the rollout
        service and, with ``training``, the sync agent and the trainer (without: the rollout
        side alone, for benchmarks that consume the stream themselves)."""
        cfg = self.resolve()
        if not cfg.nats.url:
            self.nats = EmbeddedNats(self.run_dir, port=cfg.nats.embedded_port, max_payload=cfg.derived.max_message_bytes,
                                     sync_always=cfg.nats.sync_always, user=cfg.nats.user,
                                     password=secret(cfg.security.nats_password), host=cfg.nats.embedded_host,
                                     jetstream_dir=cfg.nats.store_dir)
            self.doc["nats"]["url"] = self.nats.start()
            write_endpoint(self.nats)
            progress(f"NATS JetStream at {self.doc['nats']['url']}")
        if cfg.engines.backend == "local" and not cfg.engines.urls:
            # imported here: asyncrl imports components only lazily
            from local_engine.settings import EngineSettings

            urls = []
            progress(f"starting {cfg.engines.num_local} local engine(s) with {cfg.model.path} ...")
            for i, port in zip(range(cfg.engines.num_local), self.engine_ports, strict=True):
                engine = EngineSettings.for_run(cfg, port)  # engines.local + the model and run sections
                engine = engine.model_copy(update={"api_key": secret(cfg.engines.api_key)})  # passed in its environment
                self._child(f"engine-{i}", [sys.executable, "-m", "launcher", "engine", *engine.to_argv()], env=engine.secret_env())
                urls.append(f"http://127.0.0.1:{port}")
            for i, url in enumerate(urls):
                self.children[f"engine-{i}"].wait_ready(lambda u=url: http_ok(f"{u}/health"), ENGINE_READY_S)
            self.doc["engines"]["urls"] = urls
            progress(f"{len(urls)} local engine(s) at {', '.join(urls)}")
        cfg = RunConfig.model_validate(self.doc)
        path = self.write_config(cfg)
        rollout_url = self.doc["sync"]["rollout_url"]
        progress("starting the rollout service (tokenizer, dataset, NATS stream) ...")
        self._child("rollout", [sys.executable, "-m", "launcher", "rollout", str(path)])
        self.children["rollout"].wait_ready(lambda: http_ok(f"{rollout_url}/health"), SERVICE_READY_S)
        progress(f"rollout service at {rollout_url}")
        self.urls = {"rollout": rollout_url, "nats": self.doc["nats"]["url"]}
        if not training:
            return cfg
        self._child("sync-agent", [sys.executable, "-m", "launcher", "sync-agent", str(path)])
        self.children["sync-agent"].wait_ready(lambda: http_ok(f"{self.doc['sync']['url']}/health"), SERVICE_READY_S)
        progress(f"sync agent at {self.doc['sync']['url']}")
        self._child("trainer", [sys.executable, "-m", "launcher", "trainer", str(path)])
        progress(f"trainer started (torchrun, {cfg.trainer.nproc_per_node} rank(s)); logs in {self.run_dir / 'logs'}")
        self.urls = {"rollout": rollout_url, "sync": self.doc["sync"]["url"], "nats": self.doc["nats"]["url"]}
        return cfg

    def nats_auth(self) -> dict[str, str | None]:
        """``user`` and ``password`` for :func:`asyncrl.jetstream.connect` to this stack's NATS."""
        return {"user": self.doc["nats"].get("user"), "password": self.doc["security"].get("nats_password")}

    def exited(self) -> list[tuple[str, int]]:
        """Children that are no longer running, with their exit codes."""
        return [(name, code) for name, child in self.children.items() if (code := child.poll()) is not None]

    def stop(self) -> None:
        for name in reversed(list(self.children)):
            self.children[name].stop()
        if self.nats is not None:
            self.nats.stop()
