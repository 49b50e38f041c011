"""Starting the whole run as child processes, and watching them.

``Stack.start`` brings up, in order, each one ready before the next: the embedded NATS
(unless ``nats.url``), the local engines (unless ``engines.urls``), the rollout service, the
sync agent and the trainer (torchrun). A port the config names is kept; every unset one
(``rollout.port``, ``sync.port``, ``trainer.metrics_port``, ``nats.embedded_port``, the
engines') is a free loopback port, all drawn at start in one draw; tokens are generated when
the config has none. The resolved config (ports, URLs, tokens) is written to
``<run dir>/config.yaml`` (mode 600: it holds the tokens) and every child reads it, so
every process agrees on one document; ``<run dir>/run.env`` (mode 600) has the URLs and tokens
as shell variables for the user's ``curl``. Logs go to ``<run dir>/logs/<child>.log``.

``Stack.poll`` reports a child that exited; ``Stack.stop`` stops everything in reverse order
(SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from asyncrl.config import RunConfig, revealed_document, secret
from asyncrl.files import write_private
from asyncrl.jetstream import EmbeddedNats, write_endpoint
from asyncrl.launch import ChildProcess, http_ok
from asyncrl.listen_ports import distinct_free_ports, port_taken
from launcher.config_cli import resolved_document

RUN_ENV = "run.env"  # <run dir>/run.env: the run's URLs and tokens for a shell (mode 600)
ENGINE_READY_S = 240.0  # model load; builtin:smollm2-135m converts a GGUF on first use
SERVICE_READY_S = 120.0  # rollout service: tokenizer, dataset, NATS stream; sync agent: instant


class PortInUse(RuntimeError):
    """A port the config names is taken on this machine, or cannot be bound there (the message
    names the key and the fix)."""


def refuse_taken_ports(cfg: RunConfig) -> None:
    """Raise :class:`PortInUse` for the first port the config names that another process holds,
    before anything starts: a child would otherwise fail later with only its log to say why."""
    named = [("rollout.port", cfg.rollout.host, cfg.rollout.port), ("sync.port", cfg.sync.host, cfg.sync.port),
             ("trainer.metrics_port", cfg.trainer.metrics_host, cfg.trainer.metrics_port)]
    if not cfg.nats.url:
        named.append(("nats.embedded_port", cfg.nats.embedded_host, cfg.nats.embedded_port))
    given = [(key, port) for key, _, port in named if port]
    for i, (key, port) in enumerate(given):
        twin = next((k for k, p in given[:i] if p == port), None)
        if twin is not None:
            raise PortInUse(f"{key}={port} is also {twin}: two services cannot listen on one port; name another, "
                            f"or leave {key} unset and asyncrl up draws one")
    for key, host, port in named:
        if not port:
            continue
        try:
            taken = port_taken(host, port)
        except OSError as exc:
            raise PortInUse(f"{key}={port} cannot be bound on {host}: {exc.strerror or exc}: name another port or host, "
                            f"or leave {key} unset and asyncrl up draws one") from None
        if taken:
            raise PortInUse(f"{key}={port} is in use on {host} (another process listens there): name a free port, "
                            f"or leave {key} unset and asyncrl up draws one")


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
    nats_url: str | None = None
    """The run's NATS: `nats.url`, or the embedded server this stack started."""

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
        # a port the user named is kept; every other one is drawn free, all in one draw so no two
        # services get the same one (and two runs on one machine never share a fixed default)
        named = {"rollout": cfg.rollout.port, "sync": cfg.sync.port, "metrics": cfg.trainer.metrics_port}
        if not cfg.nats.url:
            named["nats"] = cfg.nats.embedded_port
        refuse_taken_ports(cfg)
        engines = cfg.engines.num_local if starts_engines else 0
        spare = iter(distinct_free_ports(sum(1 for p in named.values() if not p) + engines))
        ports = {name: port or next(spare) for name, port in named.items()}
        if "nats" in ports:
            doc["nats"]["embedded_port"] = ports["nats"]
        doc["rollout"]["port"] = ports["rollout"]
        doc["sync"]["port"] = ports["sync"]
        doc["sync"]["url"] = f"http://127.0.0.1:{ports['sync']}"
        doc["sync"]["rollout_url"] = f"http://127.0.0.1:{ports['rollout']}"
        doc["trainer"]["metrics_port"] = ports["metrics"]
        self.engine_ports = list(spare)
        doc["run"]["dir"] = str(self.run_dir)
        self.doc = doc
        return RunConfig.model_validate(doc)

    def write_config(self, cfg: RunConfig) -> Path:
        path = self.run_dir / "config.yaml"
        write_private(path, yaml.safe_dump(self.doc, sort_keys=False))
        (self.run_dir / "config.resolved.yaml").write_text(yaml.safe_dump(resolved_document(cfg), sort_keys=False))
        write_private(self.run_dir / RUN_ENV, "".join(f"{k}={shlex.quote(v)}\n" for k, v in self.addresses().items()))
        self.resolved_path = path
        return path

    def addresses(self) -> dict[str, str]:
        """What a user's shell needs to reach this run (``<run dir>/run.env``, sourced with
        ``. runs/demo/run.env``): the services' URLs and the tokens they take, by the names
        docs/deployment.md uses for a compose run."""
        doc, sec = self.doc, self.doc["security"]
        out = {"ROLLOUT_URL": doc["sync"]["rollout_url"], "SYNC_URL": doc["sync"]["url"],
               "TRAINER_METRICS_URL": f"http://127.0.0.1:{doc['trainer']['metrics_port']}/metrics",
               "ADMIN_TOKEN": sec.get("admin_token"), "API_TOKEN": sec.get("api_token"), "SYNC_TOKEN": sec.get("sync_token"),
               "NATS_URL": self.nats_url}
        if doc["engines"].get("urls"):
            out.update(ENGINE_URL=doc["engines"]["urls"][0], ENGINE_API_KEY=doc["engines"].get("api_key"))
        return {k: str(v) for k, v in out.items() if v}

    def start(self, progress=print, training: bool = True) -> RunConfig:
        """Start NATS (unless ``nats.url``), local engines (unless ``engines.urls``), the rollout
        service and, with ``training``, the sync agent and the trainer (without: the rollout
        side alone, for benchmarks that consume the stream themselves)."""
        cfg = self.resolve()
        self.nats_url = cfg.nats.url
        if not cfg.nats.url:
            self.nats = EmbeddedNats(self.run_dir, port=cfg.nats.embedded_port, max_payload=cfg.derived.max_message_bytes,
                                     sync_always=cfg.nats.sync_always, user=cfg.nats.user,
                                     password=secret(cfg.security.nats_password), host=cfg.nats.embedded_host,
                                     jetstream_dir=cfg.nats.store_dir)
            # nats.url stays unset in the run's config: its services find this server by
            # <run dir>/nats/endpoint (removed at the stop), so after the run `asyncrl audit`
            # starts NATS on the store instead of waiting for an address nothing listens on
            self.nats_url = self.nats.start()
            write_endpoint(self.nats)
            progress(f"NATS JetStream at {self.nats_url}")
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
        self.urls = {"rollout": rollout_url, "nats": self.nats_url}
        if not training:
            return cfg
        self._child("sync-agent", [sys.executable, "-m", "launcher", "sync-agent", str(path)])
        self.children["sync-agent"].wait_ready(lambda: http_ok(f"{self.doc['sync']['url']}/health"), SERVICE_READY_S)
        progress(f"sync agent at {self.doc['sync']['url']}")
        self._child("trainer", [sys.executable, "-m", "launcher", "trainer", str(path)])
        progress(f"trainer started (torchrun, {cfg.trainer.nproc_per_node} rank(s)); logs in {self.run_dir / 'logs'}")
        self.urls = {"rollout": rollout_url, "sync": self.doc["sync"]["url"], "nats": self.nats_url}
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
