"""Where each part of a run goes in a Slurm allocation, and whether the allocation can hold it.

:func:`requirements` checks a config before submission (``asyncrl slurm``): the nodes and the
GPUs per node the placement needs against the ``slurm`` section's allocation, with a message
naming both numbers. :func:`place` maps the hostnames of a real allocation (``scontrol show
hostnames``, in the job) onto roles. The layout (the ``slurm`` section's docstring):

- trainer: the first ``trainer.nnodes`` hosts, GPUs ``0 .. nproc_per_node-1`` of each;
- NATS, the rollout service, the sync agent: the first host (the batch host);
- engines: ``engines_per_node`` on each of the next ``slurm.engine_nodes`` hosts (GPUs from 0),
  or, with ``engine_nodes = 0``, on the first host after the trainer's GPUs.

Each engine gets ``engines.gpus_per_engine`` consecutive GPUs (none on a CPU run).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config import RunConfig


class PlacementError(ValueError):
    """The allocation cannot hold the configured placement (the message names both numbers)."""


@dataclass(frozen=True)
class EngineSlot:
    index: int
    host: str
    gpus: tuple[int, ...]
    """Indices among the node's GPUs (empty on a CPU run)."""


@dataclass(frozen=True)
class Placement:
    batch_host: str
    trainer_hosts: tuple[str, ...]
    trainer_gpus: tuple[int, ...]
    engines: tuple[EngineSlot, ...]


@dataclass(frozen=True)
class Requirements:
    nodes: int
    gpus_per_node: int
    """GPUs the busiest node needs (0 on a CPU run)."""
    engines: int


def _gpus_per_engine(cfg: RunConfig) -> int:
    return cfg.engines.gpus_per_engine if cfg.slurm.gpus_per_node > 0 else 0


def requirements(cfg: RunConfig) -> Requirements:
    """What the placement needs; raises :class:`PlacementError` when the ``slurm`` section's
    allocation is smaller, or the config cannot be placed at all."""
    s, t = cfg.slurm, cfg.trainer
    nodes = t.nnodes + s.engine_nodes
    if s.nodes is not None and s.nodes < nodes:
        raise PlacementError(
            f"the allocation is too small: slurm.nodes={s.nodes} but the placement needs {nodes} nodes "
            f"(trainer.nnodes={t.nnodes} + slurm.engine_nodes={s.engine_nodes})")
    if cfg.engines.urls:
        raise PlacementError("engines.urls is set: asyncrl slurm starts the run's engines itself; leave it empty")
    if cfg.nats.url:
        raise PlacementError("nats.url is set: asyncrl slurm starts the run's NATS on the batch host; leave it empty")
    if cfg.engines.backend == "local" and s.gpus_per_node > 0:
        raise PlacementError("engines.backend=local runs on CPUs: set slurm.gpus_per_node=0, or engines.backend=sglang")
    if t.device == "cuda" and s.gpus_per_node == 0:
        raise PlacementError("trainer.device=cuda but slurm.gpus_per_node=0: the allocation would have no GPU")
    per_engine = _gpus_per_engine(cfg)
    trainer_gpus = t.nproc_per_node if t.device == "cuda" else 0
    engine_node_gpus = s.engines_per_node * per_engine
    first_node = trainer_gpus + (engine_node_gpus if s.engine_nodes == 0 else 0)
    busiest = max(first_node, engine_node_gpus if s.engine_nodes else 0)
    if busiest > s.gpus_per_node:
        if s.engine_nodes == 0:
            detail = (f"trainer.nproc_per_node={trainer_gpus} + slurm.engines_per_node={s.engines_per_node} "
                      f"x engines.gpus_per_engine={per_engine} on the trainer's first node")
        elif first_node == busiest:
            detail = f"trainer.nproc_per_node={trainer_gpus} on each trainer node"
        else:
            detail = f"slurm.engines_per_node={s.engines_per_node} x engines.gpus_per_engine={per_engine} on each engine node"
        raise PlacementError(
            f"the allocation is too small: slurm.gpus_per_node={s.gpus_per_node} but the placement needs {busiest} GPUs "
            f"per node ({detail})")
    engines = s.engines_per_node * max(1, s.engine_nodes)
    return Requirements(nodes=nodes, gpus_per_node=busiest, engines=engines)


def place(cfg: RunConfig, hosts: list[str]) -> Placement:
    """The roles of ``hosts`` (the allocation's nodes, in Slurm's order)."""
    need = requirements(cfg)
    if len(hosts) < need.nodes:
        raise PlacementError(f"the allocation has {len(hosts)} nodes ({', '.join(hosts)}) but the placement needs "
                             f"{need.nodes} (trainer.nnodes={cfg.trainer.nnodes} + slurm.engine_nodes={cfg.slurm.engine_nodes})")
    s, t = cfg.slurm, cfg.trainer
    trainer_hosts = tuple(hosts[: t.nnodes])
    trainer_gpus = tuple(range(t.nproc_per_node)) if t.device == "cuda" else ()
    per_engine = _gpus_per_engine(cfg)
    if s.engine_nodes:
        engine_hosts, first_gpu = hosts[t.nnodes: t.nnodes + s.engine_nodes], 0
    else:
        engine_hosts, first_gpu = hosts[:1], len(trainer_gpus)
    slots = []
    for host in engine_hosts:
        for k in range(s.engines_per_node):
            start = first_gpu + k * per_engine
            slots.append(EngineSlot(len(slots), host, tuple(range(start, start + per_engine))))
    return Placement(batch_host=hosts[0], trainer_hosts=trainer_hosts, trainer_gpus=trainer_gpus, engines=tuple(slots))
