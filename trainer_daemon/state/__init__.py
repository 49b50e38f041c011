"""What survives a trainer: checkpoints, the ledger of what was trained, the version lineage, the Hugging Face export."""
