"""The policy (and the optional frozen reference) as Hugging Face causal LMs, FSDP2-sharded over
more than one rank, the optimiser and the learning-rate schedule.

- Loading: :func:`asyncrl.models.load_model` (builtin specs or a local HF directory) in fp32:
  fp32 master weights. The seed matters only for models built in code; every rank builds the
  same weights and FSDP keeps its shard.
- More than one rank: ``fully_shard`` on every decoder block (modules whose class is in the
  model's ``_no_split_modules``), then on the root, which holds the embeddings, the final norm
  and the (possibly tied) LM head. Tied embeddings stay one parameter.
  ``trainer.mixed_precision=bf16`` casts parameters to bf16 for compute and reduces gradients
  in fp32 (``MixedPrecisionPolicy``).
- One rank: the plain module on the device, no FSDP. There is nothing to shard, and FSDP2 on
  one rank still pays its per-block hooks, an all-gather and a reduce-scatter copy per block
  and DTensor optimiser state (docs/benchmarks.md, "Trainer"). ``mixed_precision=bf16`` is
  ``torch.autocast`` around the forward (fp32 weights and gradients, matmuls in bf16), which
  differs from FSDP's policy only in which ops run in bf16. Checkpoints are DCP either way and
  load across world sizes (DCP reshards).
- Activation checkpointing (``actor.activation_checkpointing``): Hugging Face's own
  non-reentrant gradient checkpointing of the decoder blocks.
- Optimiser: AdamW (``actor.optim``); schedule: linear warm-up, then constant or cosine to 0 at
  ``total_updates`` optimiser updates.

Not covered: tensor/sequence parallelism, CPU offload of parameters, HSDP meshes.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from asyncrl.models import load_model
from trainer_daemon.policy import segmented_attention

log = logging.getLogger(__name__)


def _mp_policy(mixed_precision: str) -> MixedPrecisionPolicy | None:
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_model(model: torch.nn.Module, device: torch.device, world_size: int, mixed_precision: str) -> torch.nn.Module:
    """``fully_shard`` each decoder block, then the root; on one rank the plain module on
    ``device`` with bf16 autocast when asked (module docstring)."""
    if world_size == 1:
        return _single_rank(model, device, mixed_precision)
    mesh = init_device_mesh(device.type, (world_size,))
    kwargs = {"mesh": mesh}
    mp = _mp_policy(mixed_precision)
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _single_rank(model: torch.nn.Module, device: torch.device, mixed_precision: str) -> torch.nn.Module:
    model.to(device)
    if mixed_precision == "bf16":
        # the instance's forward runs under autocast; state-dict names are unchanged (no wrapper module)
        model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is FSDP2-sharded (more than one rank)."""
    return isinstance(model, FSDPModule)


def attention_for(setting: str, device: torch.device, packed: bool) -> str:
    """The attention implementation ``actor.attn_implementation`` resolves to (its docstring)."""
    if setting != "auto":
        return setting
    if packed and device.type == "cuda":
        import importlib.util

        return "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flex_attention"
    return segmented_attention.NAME if packed else "sdpa"


def set_attention(model: torch.nn.Module, implementation: str) -> None:
    """Switch ``model``'s attention kernel (before sharding or compiling)."""
    if getattr(model.config, "_attn_implementation", None) == implementation:
        return
    if implementation == segmented_attention.NAME:
        segmented_attention.register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    else:  # older transformers: every attention module reads the shared config at forward time
        model.config._attn_implementation = implementation


def build_policy(spec: str, seed: int, device: torch.device, world_size: int, mixed_precision: str = "fp32",
                 activation_checkpointing: bool = False, compile_blocks: bool = False,
                 attn_implementation: str = "sdpa", lora: tuple[int, float, str | list[str]] | None = None) -> torch.nn.Module:
    """The trainable, sharded policy in train mode, with ``attn_implementation`` (see
    :func:`attention_for`). ``compile_blocks`` (``actor.use_torch_compile``): ``torch.compile``
    every decoder block in place (dynamic shapes: micro-batch lengths vary), before sharding,
    as torchtitan does; parameter names are unchanged. ``lora``: ``(rank, alpha, target
    modules)``: LoRA adapters, the only trainable parameters (:mod:`trainer_daemon.policy.lora`)."""
    model = load_model(spec, dtype="float32", seed=seed)
    model.config.use_cache = False
    set_attention(model, attn_implementation)
    if lora is not None:
        from trainer_daemon.policy.lora import add_adapters

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the adapters' initialisation: the same on every rank and every start
            add_adapters(model, *lora)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile_blocks:
        for block in decoder_blocks(model):
            block.compile(dynamic=True)
    model.train()
    return shard_model(model, device, world_size, mixed_precision)


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder blocks (the module types it names in ``_no_split_modules``)."""
    block_types = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_types]
    if not blocks:
        raise ValueError(f"{type(model).__name__} declares no decoder block types (_no_split_modules)")
    return blocks


def build_reference(spec: str, seed: int, device: torch.device, world_size: int, mixed_precision: str = "fp32",
                    attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A frozen, sharded copy of the initial policy for the KL loss (no grads, no optimiser state)."""
    model = load_model(spec, dtype="float32", seed=seed)
    model.config.use_cache = False
    set_attention(model, attn_implementation)
    model.requires_grad_(False)
    model.eval()
    return shard_model(model, device, world_size, mixed_precision)


def policy_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the policy's input embedding: every token id it trains must be below it (an
    FSDP2-sharded embedding keeps the full count in ``num_embeddings``)."""
    return int(model.get_input_embeddings().num_embeddings)


def build_optimizer(model: torch.nn.Module, optim) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters with ``actor.optim``'s settings."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)


def lr_factor(update: int, warmup: int, schedule: str, total: int | None) -> float:
    """Multiplier of the base learning rate before optimiser update number ``update`` (0-based)."""
    if warmup and update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    if not total:
        raise ValueError("the cosine schedule needs a total number of updates (trainer.total_training_steps)")
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, optim, total_updates: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    if optim.lr_scheduler == "cosine" and not total_updates:
        raise ValueError("actor.optim.lr_scheduler=cosine needs trainer.total_training_steps or rollout.total_rollout_steps")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda u: lr_factor(u, optim.warmup_steps, optim.lr_scheduler, total_updates)
    )


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict with Hugging Face names: CPU tensors on rank 0, ``{}``
    elsewhere; always copies (a sync reads them in the background while training goes on).
    A collective: every rank must call it."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_sharded(model):
        # one rank: cpu_offload of a CPU module returns the live parameters themselves
        live = {t.data_ptr() for t in model.state_dict().values()}
        full = {k: (t.clone() if t.data_ptr() in live else t) for k, t in full.items()}
    return full


def engine_weights(full: dict[str, torch.Tensor], tied: bool, dtype: torch.dtype | None = None,
                   lora_scaling: float | None = None) -> dict[str, torch.Tensor]:
    """What engines load by name: the full state dict without ``lm_head.weight`` when the
    embeddings are tied (SGLang and local_engine load the embedding for both), cast to the
    engines' dtype; with ``lora_scaling`` (``lora_alpha / lora_rank``) the adapters merged
    into the base model's weights first (:func:`trainer_daemon.policy.lora.merged_weights`)."""
    if lora_scaling is not None:
        from trainer_daemon.policy.lora import merged_weights

        full = merged_weights(full, lora_scaling)
    out = {}
    for name, t in full.items():
        if tied and name == "lm_head.weight":
            continue
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t
    return out
