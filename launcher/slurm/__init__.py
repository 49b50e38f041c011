"""Running the whole loop on a Slurm cluster: ``asyncrl slurm`` writes (and submits) the batch
script; ``asyncrl slurm-job`` is the driver it runs inside the allocation (docs/deployment.md)."""
