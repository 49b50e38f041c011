"""The python tool's settings (``rollout.tool_options.python``): limits, isolation, paths.
Read by :mod:`tools.python_sandbox` (the tool) and :mod:`tools.sandbox_results` (what a run's
outcome tells the model)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MIB = 2**20


class PythonSandboxConfig(BaseModel):
    """Limits and isolation of the ``python`` tool; defaults suit short agent computations."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    wall_timeout_s: float = Field(10.0, gt=0, le=600)
    """Longest wall-clock time of one run; a call's own timeout_s can only shorten it."""
    cpu_time_s: int = Field(10, ge=1, le=600)
    """RLIMIT_CPU per process: SIGXCPU at this many CPU seconds, SIGKILL one second later."""
    memory_mb: int = Field(512, ge=64, le=65536)
    """RLIMIT_AS per process (virtual memory, MiB); Python needs ~30 MiB to start."""
    max_processes: int = Field(16, ge=1, le=4096)
    """RLIMIT_NPROC: processes+threads of the run (see the module docstring for what counts)."""
    max_file_size_mb: int = Field(16, ge=0, le=65536)
    """RLIMIT_FSIZE: largest file the run may write (MiB); writes beyond fail with EFBIG."""
    max_open_files: int = Field(64, ge=16, le=65536)
    """RLIMIT_NOFILE: open file descriptors per process."""
    max_output_bytes: int = Field(16_384, ge=256, le=16 * MIB)
    """Bytes kept of stdout and of stderr each (first and last halves); the rest is counted."""
    max_code_chars: int = Field(100_000, ge=1, le=10_000_000)
    """Longest program accepted."""
    max_concurrent_runs: int = Field(8, ge=1, le=4096)
    """Runs of this tool instance at once; further calls wait (within their timeout)."""
    network_isolation: Literal["auto", "namespace"] = "auto"
    """auto: a network namespace, else a process that has no network (``no_network``), else
    refuse; namespace: a network namespace or refuse. (``audit_hook`` was removed: no isolation.)"""
    pid_namespace: bool = True
    """Run the program under its own init in a new pid namespace (made together with the
    network namespace): everything it starts dies with it, and it cannot see or signal
    outside processes. False: exec the program directly (two processes fewer per run)."""
    drop_privileges: bool | None = None
    """Kept for old configs: runs always get a per-run uid (needs root); false is refused."""
    uid_base: int = Field(2_000_000_000, ge=100_000, le=2**31 - 2**23)
    """Per-run uid = uid_base + launcher pid; choose a range no real user or container uses."""
    interpreter: str | None = None
    """Python for the sandboxed code; None: this interpreter if the run's uid can use it,
    else /usr/bin/python3 or /usr/local/bin/python3."""
    hidden_paths: list[str] = Field(default_factory=list, max_length=64)
    """Directories a run must not see: in its mount namespace (root mode) each is an empty,
    read-only tmpfs. The rollout service passes its run directory and data roots (the answer
    keys, the trajectories: issue 48)."""
    work_root: str | None = None
    """Parent directory of the per-run temporary directories; None: the system default."""
    sandbox_url: str | None = Field(None, pattern=r"^unix:///.+")
    """``unix:///path/to/socket`` of a python sandbox server (``asyncrl python-sandbox``): the
    runs happen there, under its limits (a call's timeout still applies). None: in this
    process's own sandbox, which needs root (module docstring)."""

    @field_validator("network_isolation", mode="before")
    @classmethod
    def _no_weak_isolation(cls, v):
        if v == "audit_hook":
            raise ValueError("network_isolation='audit_hook' was removed: an audit hook does not stop native code "
                             "(a subprocess escapes it); use 'auto' or 'namespace', or sandbox_url")
        return v

    @field_validator("drop_privileges")
    @classmethod
    def _never_the_service_uid(cls, v):
        if v is False:
            raise ValueError("drop_privileges=false would run model code as the service's own uid (its tokens, its "
                             "files, its processes): refused; run the service as root or use sandbox_url")
        return v
