"""The ``slurm`` config section: how ``asyncrl slurm`` asks Slurm for an allocation and
places the run on it (launcher/slurm; docs/deployment.md, "Slurm").

Placement: the trainer runs on the allocation's first ``trainer.nnodes`` nodes (the first
is the batch host, where NATS, the rollout service and the sync agent run too); each of the
next ``engine_nodes`` nodes runs ``engines_per_node`` engines. With ``engine_nodes = 0`` the
engines share the trainer's first node (a CPU run, or one GPU node split between both).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from asyncrl.config.sections_core import Section

SBATCH_TIME_PATTERN = r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$|^\d+-\d{1,2}$"


class SlurmConfig(Section):
    job_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """``#SBATCH --job-name``. None: ``asyncrl-<run.id>``."""
    partition: str | None = Field(None, pattern=r"^[A-Za-z0-9_.,-]{1,200}$")
    """``#SBATCH --partition``. None: the cluster's default."""
    account: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,200}$")
    """``#SBATCH --account``."""
    qos: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,200}$")
    """``#SBATCH --qos``."""
    time: str | None = Field(None, pattern=SBATCH_TIME_PATTERN)
    """``#SBATCH --time`` in Slurm's forms (``MM``, ``HH:MM:SS``, ``D-HH``...). None: the
    partition's default limit."""
    nodes: int | None = Field(None, ge=1, le=4096)
    """Nodes to allocate. None: exactly what the placement needs (``trainer.nnodes +
    engine_nodes``); a smaller number is refused before submission."""
    engine_nodes: int = Field(0, ge=0, le=4096)
    """Nodes that run engines only. 0: the engines run on the trainer's first node."""
    engines_per_node: int = Field(1, ge=1, le=64)
    """Engines started on each engine node (on the trainer's first node when ``engine_nodes``
    is 0); each takes ``engines.gpus_per_engine`` GPUs of its node."""
    gpus_per_node: int = Field(0, ge=0, le=64)
    """``#SBATCH --gpus-per-node``. 0: a CPU run (local engines, ``trainer.device = cpu``)."""
    cpus_per_node: int | None = Field(None, ge=1, le=4096)
    """``#SBATCH --cpus-per-task`` (one task per node). None: the partition's default."""
    mem: str | None = Field(None, pattern=r"^\d+[KMGT]?$")
    """``#SBATCH --mem`` per node (``0``: all of it). None: the partition's default."""
    exclusive: bool = False
    """``#SBATCH --exclusive``: the nodes are the job's alone (ports and GPUs unshared)."""
    container_image: str | None = None
    """Run every service in this container image (pyxis/enroot: each ``srun`` gets
    ``--container-image``). The batch script itself runs on the host, with ``python``."""
    container_mounts: list[str] = Field(default_factory=list)
    """pyxis ``--container-mounts`` (``SRC:DST[:FLAGS]``); the run directory must be one."""
    python: str | None = None
    """Interpreter that has asyncrl, on every node (a venv on the shared filesystem). None:
    the one running ``asyncrl slurm``."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines the batch script runs first (``module load ...``, ``source venv/bin/activate``)."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """More ``#SBATCH`` options, one per entry, without the prefix (``--constraint=h100``)."""
    requeue: bool = True
    """``#SBATCH --requeue``: Slurm may run the job again after a node failure or preemption;
    each start resumes from the newest checkpoint."""
    time_limit_signal_s: int = Field(300, ge=0, le=86_400)
    """Seconds before the time limit at which the job stops cleanly (a checkpoint is written)
    and, with ``requeue``, puts itself back in the queue (``--signal=B:USR1@N``). 0: none."""
    engine_restarts: int = Field(3, ge=0, le=1000)
    """Times an engine that dies is started again (same node, same port) before the job fails;
    the sync agent keeps it out of rotation until a sync gives it the current weights."""
    sglang_args: list[str] = Field(default_factory=list)
    """Extra ``sglang.launch_server`` flags (``engines.backend = "sglang"``), after the ones
    asyncrl sets (model, host, port, ``--tp-size``, ``--api-key``, ``--enable-metrics``)."""
    stop_grace_s: float = Field(60.0, gt=0.0, le=3600.0)
    """Seconds each service gets to stop when the job driver stops the run in order (SIGTERM to
    the step's tasks) before srun terminates the step."""

    @field_validator("extra_sbatch")
    @classmethod
    def _sbatch_options(cls, v: list[str]) -> list[str]:
        for opt in v:
            if not opt.startswith("-") or "\n" in opt or "\r" in opt:
                raise ValueError(f"slurm.extra_sbatch entry {opt!r} must be one sbatch option (starting with -, one line)")
        return v

    @field_validator("setup", "container_mounts", "sglang_args")
    @classmethod
    def _one_line_each(cls, v: list[str]) -> list[str]:
        for item in v:
            if "\n" in item or "\r" in item:
                raise ValueError(f"{item!r} spans lines: give one entry per line")
        return v
