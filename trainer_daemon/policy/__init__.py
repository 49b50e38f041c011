"""The policy: building the FSDP2 model and optimizer, LoRA, the trainer's process group."""
