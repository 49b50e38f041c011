"""The trainer daemon: a torchrun job (FSDP2) that consumes trajectories from the run's
JetStream stream exactly once, trains on whole groups, checkpoints with DCP, and publishes new
weights to the inference engines. Entry points: ``asyncrl trainer`` (``launch.py``) and
``torchrun -m trainer_daemon`` (``__main__.py``). See docs/trainer.md; the loss math is in
``trainer_daemon.algo`` (docs/algorithms.md).

Importing this package imports nothing heavy; ``trainer_daemon.algo`` and the daemon modules
import torch themselves.
"""
