"""``asyncrl slurm-job RUN_FILE``: the job driver, run by the batch script on the batch host.

It reads the allocation (``scontrol show hostnames $SLURM_JOB_NODELIST``), places the run on it
(:mod:`launcher.slurm.placement`), and starts each service as a job step, each one ready
before the next: NATS (store ``nats.store_dir``), the engines, the rollout service, the sync
agent, the trainer (``srun torchrun`` over its nodes). Tokens, the engines' key and the NATS
password are generated for each job and written, with every address, to ``<run dir>/config.yaml``
(mode 0600), which every service reads. Ports on the batch host are found free there; an
engine finds its own on its node (:mod:`launcher.slurm.step`).

Lifecycle (what its output, ``<run dir>/logs/slurm-<job id>.out``, reports):

- the trainer exits 0 (its steps done): the services stop in reverse order, exit 0;
- SIGTERM (``scancel``): the trainer stops first (it writes a checkpoint), then the others;
  the outbox and the stream stay on disk, so a resubmitted or requeued job resumes from the
  checkpoint with nothing lost or trained twice (``asyncrl audit``);
- SIGUSR1 (``--signal=B:USR1@N``, before the time limit): the same stop, then, with
  ``slurm.requeue``, ``scontrol requeue`` puts the job back in the queue;
- an engine exits: started again on its node and port (``slurm.engine_restarts`` times); the
  sync agent keeps it out of rotation until a sync gives it the current weights;
- any other service exits, or one does not become ready: every service stops and the job fails
  (exit 1) with that service's name, exit code and log path in the output.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from asyncrl.config import ConfigError, RunConfig, load_config, revealed_document
from asyncrl.config.secrets import redact, secret_values
from asyncrl.files import atomic_write, write_private
from asyncrl.jetstream.embedded import ENDPOINT_FILE, server_config
from asyncrl.launch import ChildProcess, http_ok, log_tail, port_open
from asyncrl.listen_ports import distinct_free_ports
from launcher.slurm import steps
from launcher.slurm.placement import Placement, PlacementError, place

READY_S = {"nats": 30.0, "engine": 600.0, "rollout": 300.0, "sync-agent": 120.0}  # engines: weights from a shared disk
TICK_S = 0.5


class JobFailed(Exception):
    """A service failed: the message names it and its log."""


def log(msg: str) -> None:
    print(f"[asyncrl slurm-job {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def allocation_hosts() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise PlacementError("SLURM_JOB_NODELIST is not set: asyncrl slurm-job runs inside a Slurm job (sbatch)")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True)
    return out.stdout.split()


def _token() -> str:
    return "asyncrl-" + secrets.token_urlsafe(24)


class SlurmJob:
    def __init__(self, cfg: RunConfig, placement: Placement) -> None:
        self.cfg, self.placement = cfg, placement
        self.run_dir = Path(cfg.run_dir).resolve()
        self.launcher = steps.StepLauncher(cfg, self.run_dir)
        self.services: dict[str, ChildProcess] = {}
        self.engine_ports: dict[str, int] = {}
        self.engine_restarts: dict[str, int] = {}
        self.stop_signal: int | None = None
        self.doc: dict = {}

    # -- start --------------------------------------------------------------------------
    def resolve(self) -> dict:
        """The run's document with this job's addresses and secrets (engine URLs come later)."""
        cfg, batch = self.cfg, self.placement.batch_host
        doc = revealed_document(cfg)
        sec = doc["security"]
        for key in ("admin_token", "sync_token", "api_token"):
            sec[key] = sec[key] or _token()
        doc["engines"]["api_key"] = doc["engines"]["api_key"] or _token()
        # the admin routes (pause, weights) get a key of this job's own: a data-plane key that
        # lives longer (configured) never pauses or reloads this job's engines (issue 48)
        doc["engines"]["admin_api_key"] = doc["engines"]["admin_api_key"] or _token()
        doc["nats"]["user"] = cfg.nats.user or "asyncrl"
        sec["nats_password"] = sec["nats_password"] or _token()
        ports = dict(zip(("nats", "rollout", "sync", "metrics", "master"), distinct_free_ports(5, "0.0.0.0"), strict=True))
        # nats.url stays unset: the services find the job's server by <run dir>/nats/endpoint (removed
        # at the stop), so after the job `asyncrl audit` starts one on the store instead of waiting for it
        doc["nats"].update(embedded_port=ports["nats"], embedded_host="0.0.0.0")  # noqa: S104
        doc["rollout"].update(host="0.0.0.0", port=ports["rollout"])  # noqa: S104
        doc["sync"].update(host="0.0.0.0", port=ports["sync"], url=f"http://{batch}:{ports['sync']}",  # noqa: S104
                           rollout_url=f"http://{batch}:{ports['rollout']}")
        doc["trainer"].update(metrics_host="0.0.0.0", metrics_port=ports["metrics"], master_port=ports["master"],  # noqa: S104
                              master_addr=self.placement.trainer_hosts[0])
        doc["run"]["dir"] = str(self.run_dir)
        self.doc = doc
        return doc

    def write_config(self) -> Path:
        path = self.run_dir / "config.yaml"
        write_private(path, yaml.safe_dump(self.doc, sort_keys=False))
        return path

    def _wait(self, name: str, check: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        child = self.services[name]
        while time.monotonic() < deadline:
            if self.stop_signal is not None:
                raise KeyboardInterrupt
            if child.poll() is not None:
                raise JobFailed(self._exit_message(name, child, "exited while starting"))
            if check():
                return
            time.sleep(TICK_S)
        raise JobFailed(f"{name} did not become ready within {timeout_s:.0f} s; its log: {child.log_path}\n"
                        f"{self._tail(child)}")

    @property
    def _secrets(self) -> list[str]:
        """The configured secrets and those this job generated (``resolve``)."""
        doc = self.doc or {}
        generated = [v for v in (*doc.get("security", {}).values(), doc.get("engines", {}).get("api_key"),
                                 doc.get("engines", {}).get("admin_api_key")) if isinstance(v, str) and len(v) >= 8]
        return sorted(set(secret_values(self.cfg)) | set(generated), key=len, reverse=True)

    def _tail(self, child: ChildProcess) -> str:
        """A child's log tail for the job's output, every configured secret redacted (SGLang logs
        its server args, the api key included: issue 48)."""
        return redact(log_tail(child.log_path, 2000), self._secrets)

    def _exit_message(self, name: str, child: ChildProcess, what: str) -> str:
        return (f"{name} {what} (exit code {child.poll()}); its log: {child.log_path}; last lines:\n"
                f"{self._tail(child)}")

    @property
    def nats_endpoint(self) -> Path:
        return self.run_dir / "nats" / ENDPOINT_FILE

    def start_nats(self) -> None:
        nats, sec = self.doc["nats"], self.doc["security"]
        conf_dir = self.run_dir / "nats"
        store = Path(nats["store_dir"]) if nats["store_dir"] else conf_dir
        conf_dir.mkdir(parents=True, exist_ok=True)
        store.mkdir(parents=True, exist_ok=True)
        conf = conf_dir / "server.conf"
        write_private(conf, server_config("0.0.0.0", nats["embedded_port"], store,  # noqa: S104 - private: the password
                                          self.cfg.derived.max_message_bytes, nats["sync_always"], nats["user"],
                                          sec["nats_password"]))
        batch = self.placement.batch_host
        self.services["nats"] = self.launcher.start("nats", [batch], steps.nats_command(conf))
        self._wait("nats", lambda: port_open(batch, nats["embedded_port"]), READY_S["nats"])
        url = f"nats://{batch}:{nats['embedded_port']}"
        atomic_write(self.nats_endpoint, url + "\n")
        log(f"NATS JetStream at {url} (store {store})")

    def start_engine(self, slot_index: int) -> None:
        slot = self.placement.engines[slot_index]
        name = f"engine-{slot.index}"
        endpoint = self.launcher.endpoint_file(name)
        endpoint.unlink(missing_ok=True)
        endpoint.parent.mkdir(parents=True, exist_ok=True)
        cfg = RunConfig.model_validate(self.doc)
        command, env, extra = steps.engine_command(cfg, self.launcher.python)
        opts = steps.engine_step_opts(slot, endpoint, self.engine_ports.get(name, 0)) + extra
        self.services[name] = self.launcher.start(name, [slot.host], command, opts, env, gpus=bool(slot.gpus))

    def engine_url(self, index: int) -> str | None:
        slot = self.placement.engines[index]
        path = self.launcher.endpoint_file(f"engine-{index}")
        if not path.exists():
            return None
        port = json.loads(path.read_text())["port"]
        self.engine_ports[f"engine-{index}"] = port
        return f"http://{slot.host}:{port}"

    def start_engines(self) -> None:
        for i in range(len(self.placement.engines)):
            self.start_engine(i)
        urls = []
        for i in range(len(self.placement.engines)):
            name = f"engine-{i}"
            self._wait(name, lambda i=i: (u := self.engine_url(i)) is not None and http_ok(f"{u}/health"), READY_S["engine"])
            urls.append(self.engine_url(i))
        self.doc["engines"]["urls"] = urls
        log(f"{len(urls)} engine(s) at {', '.join(urls)}")

    def start(self) -> None:
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        log(f"job {os.environ.get('SLURM_JOB_ID')} (start {int(restart) + 1}) on {', '.join(self.placement_hosts())}; "
            f"run {self.cfg.run.id} in {self.run_dir}")
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.resolve()
        self.start_nats()
        self.start_engines()
        path = self.write_config()
        batch = self.placement.batch_host
        for name, module, url in (("rollout", "rollout", self.doc["sync"]["rollout_url"]),
                                  ("sync-agent", "sync-agent", self.doc["sync"]["url"])):
            self.services[name] = self.launcher.start(name, [batch], [self.launcher.python, "-m", "launcher", module, str(path)])
            self._wait(name, lambda u=url: http_ok(f"{u}/health"), READY_S[name])
            log(f"{name} at {url}")
        hosts = list(self.placement.trainer_hosts)
        self.services["trainer"] = self.launcher.start(
            "trainer", hosts, [self.launcher.python, "-m", "launcher", "trainer", str(path)],
            steps.trainer_step_opts(self.placement.trainer_gpus), gpus=bool(self.placement.trainer_gpus))
        log(f"trainer started on {', '.join(hosts)} ({self.cfg.trainer.nproc_per_node} rank(s) per node); "
            f"logs in {self.run_dir / 'logs'}")

    def placement_hosts(self) -> list[str]:
        p = self.placement
        return list(dict.fromkeys([p.batch_host, *p.trainer_hosts, *(e.host for e in p.engines)]))

    # -- run ----------------------------------------------------------------------------
    def watch(self) -> str:
        """Until the trainer finishes or a signal comes; raises JobFailed when a service fails."""
        while self.stop_signal is None:
            for name, child in list(self.services.items()):
                code = child.poll()
                if code is None:
                    continue
                if name == "trainer" and code == 0:
                    return "the trainer finished its steps"
                if name.startswith("engine-"):
                    self.restart_engine(name, child)
                    continue
                raise JobFailed(self._exit_message(name, child, "exited"))
            time.sleep(TICK_S)
        return f"signal {signal.Signals(self.stop_signal).name}"

    def restart_engine(self, name: str, child: ChildProcess) -> None:
        used = self.engine_restarts.get(name, 0)
        if used >= self.cfg.slurm.engine_restarts:
            raise JobFailed(self._exit_message(name, child, f"exited for the {used + 1}th time (slurm.engine_restarts={used})"))
        self.engine_restarts[name] = used + 1
        log(f"{name} exited with code {child.poll()}; starting it again on its node and port "
            f"({used + 1} of {self.cfg.slurm.engine_restarts}); log {child.log_path}")
        self.start_engine(int(name.split("-")[1]))

    def stop(self) -> None:
        """Stop every service in reverse order of start (the trainer first: it checkpoints)."""
        grace = self.cfg.slurm.stop_grace_s
        for name in ["trainer", "sync-agent", "rollout", *sorted(n for n in self.services if n.startswith("engine-")), "nats"]:
            child = self.services.get(name)
            if child is not None and child.poll() is None:
                code = self.launcher.stop(name, child, grace)
                log(f"stopped {name} (exit code {code})")
        self.nats_endpoint.unlink(missing_ok=True)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        cfg = load_config(argv[0], [])
        job = SlurmJob(cfg, place(cfg, allocation_hosts()))
    except (ConfigError, PlacementError, subprocess.CalledProcessError) as exc:
        print(f"asyncrl slurm-job: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum, frame):
        job.stop_signal = job.stop_signal or signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    failed = None
    try:
        job.start()
        reason = job.watch()
    except JobFailed as exc:
        failed, reason = str(exc), "a service failed"
    except KeyboardInterrupt:
        reason = f"signal {signal.Signals(job.stop_signal).name} while starting"
    log(f"stopping: {reason}")
    job.stop()
    if failed:
        print(f"asyncrl slurm-job: the job failed: {failed}", file=sys.stderr, flush=True)
        return 1
    if job.stop_signal == signal.SIGUSR1 and cfg.slurm.requeue:
        log("the time limit is near: requeueing the job (it resumes from the checkpoint just written)")
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
    log("done")
    return 0
