"""A warmed-up builtin:tiny for tests that need tool calls: a short SFT on the demo task
(format only: it calls the calculator and answers in a box, not reliably correctly).

Built once and cached under ``$ASYNCRL_CACHE_DIR/test-models`` keyed by a hash of the code
and assets that determine it; a file lock keeps parallel test processes from building it
twice.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import asyncrl.models.builtin as builtin
import rollout_service.agent.chat as chat_mod
import rollout_service.data.demo_sft as demo_sft
import trainer_daemon.sft as sft_mod
from asyncrl.models.cache import build_once
from asyncrl.models.smollm2 import cache_dir

SFT_STEPS = 120  # enough for the format (tool call, boxed answer); copying digits needs far more


def _key() -> str:
    h = hashlib.sha256()
    for mod in (builtin, chat_mod, demo_sft, sft_mod):
        h.update(Path(mod.__file__).read_bytes())
    for asset in (builtin._TOKENIZER_JSON, builtin._CHAT_TEMPLATE):
        h.update(Path(asset).read_bytes())
    h.update(str(SFT_STEPS).encode())
    return h.hexdigest()[:16]


def warm_tiny_model() -> Path:
    def build(out: Path) -> None:
        import torch

        from asyncrl.models import load_model, load_tokenizer
        from rollout_service.agent.chat import ChatTokenizer
        from tools.registry import ToolRegistry

        torch.manual_seed(0)
        tok = load_tokenizer("builtin:tiny")
        model = load_model("builtin:tiny")
        chat = ChatTokenizer(tok, ToolRegistry.from_names(["calculator"]).schemas())
        examples = demo_sft.demo_sft_examples(chat, 1000, seed=1)
        sft_mod.sft(model, examples, sft_mod.SftConfig(steps=SFT_STEPS, batch_size=16, lr=3e-3, log_every=0), tok.pad_token_id)
        sft_mod.save_hf(model, tok, out)

    return build_once(cache_dir() / "test-models" / f"tiny-arith-{_key()}", build)
