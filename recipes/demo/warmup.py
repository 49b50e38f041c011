"""Starting policies made by a short supervised warm-up on the demo task, built once and cached.

:data:`DEMO` is ``builtin:tiny-arith``, the policy ``asyncrl up``'s built-in demo starts
from: builtin:tiny after an SFT that teaches the *format* of the demo task — call a tool
with the question's expression, then answer with the tool's result in ``\\boxed{}`` — with
a deliberately bad habit: most examples call ``estimate`` (rounded, usually wrong) and a
minority call ``calculator`` (exact). The warmed-up policy therefore starts with a low
reward, and the RL run has one clear thing to learn: choose the exact tool.

Entry points:

- ``python -m recipes.demo.warmup`` builds :data:`DEMO` (progress on stderr) and prints its
  directory on stdout — what ``asyncrl up`` and ``bench/gpu.py`` run, as a child process;
- ``python -m recipes.demo.warmup --export DIR`` also copies it to ``DIR`` (compose's CPU
  profile: the ``model-init`` service writes it into the models directory);
- ``python -m recipes.demo.warmup --rebuild`` builds it from scratch into the cache even
  though the package ships it (what ``./dev test-shipped`` runs); ``--rebuild --prefix``
  builds only its first :data:`PREFIX_STEPS` steps (what ``./dev test`` runs: every build
  records the digest of its weights after those steps in :data:`PREFIX_FILE`, the shipped one
  too, and the learning-rate schedule does not depend on the number of steps, so a short
  build reproduces the shipped build's first steps bit for bit);
- ``python -m recipes.demo.warmup --ship`` builds it from scratch and writes it into the
  package (``asyncrl/models/assets/tiny-arith/``, ~4 MB, with the recipe key it was built
  from), so that a first run takes it at once instead of training 2 minutes;
- :func:`warm_up` ``(recipe, progress) -> Path`` for any :class:`WarmupRecipe` (the tests'
  warm model is one), :func:`export` ``(recipe, dest)``.

:data:`DEMO` comes from the package when its shipped build carries the current recipe key
(tests/recipes/test_warmup_shipped.py checks that it does, and that building it again here
reproduces it tensor for tensor); any other recipe, or a DEMO whose code changed since it was
shipped, is built and cached under ``$ASYNCRL_CACHE_DIR/models/<name>-<key>``, the key hashing the
recipe and the code and assets that determine the weights; concurrent processes build it
once (:func:`asyncrl.models.cache.build_once`). The examples are :mod:`recipes.demo.sft_data`
(the rollout service's chat template and tool-call format, :mod:`asyncrl.chat`); the training is
the trainer's SFT (:mod:`trainer_daemon.sft`), imported when a build runs.

Every build trains with portable numerics (:mod:`trainer_daemon.compute.portable_numerics`): in a
child process whose environment pins the CPU kernels, so that the same recipe gives the same
bits on every x86-64 machine (the shipped build is checked against a rebuild on whatever CPU
the suite runs on), at about half the speed of the free kernels.

Not covered: other tasks or base models than the builtin ones (a recipe names them, the
example builder knows only the demo task).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WarmupRecipe:
    """What a warm-up trains on and how; every field enters the cache key."""

    name: str
    tools: tuple[str, ...]
    exact_fraction: float  # share of examples that call the exact calculator (the rest: estimate)
    level: int | None  # demo-task difficulty (ArithSpec.level); None: the default spec
    steps: int
    batch_size: int
    lr: float
    examples: int
    base: str = "builtin:tiny"
    seed: int = 1  # of the examples; the model's init and the SFT use seed 0


# Measured on 2 CPU cores by bench/warmup.py (docs/benchmarks.md, "The demo's warm-up"): at lr
# 1e-3 the operands and the tool's result are copied on held-out questions (greedy) after
# ~420 steps of 16, but sampled at T = 1, as RL samples, the policy needs the longer recipe:
# with 420 x 16 the demo started at reward 0.06 and did not learn in 240 steps; with 550 x 32
# it starts at ~0.24 and learns to 0.85. Batches of 8, lr 2e-3 (with or without decay) and
# bf16 autocast learnt nothing. Operands of varying width are learnt far more slowly than
# fixed ones — hence level 0.
DEMO = WarmupRecipe(name="tiny-arith", tools=("calculator", "estimate"), exact_fraction=0.2, level=0,
                    steps=550, batch_size=32, lr=1e-3, examples=4000)
SPEC = "builtin:tiny-arith"  # the model.path that names DEMO in a run config
MOE_DEMO = dataclasses.replace(DEMO, name="tiny-moe-arith", base="builtin:tiny-moe")
"""DEMO's warm-up on ``builtin:tiny-moe`` (issue 53's learning run with routing replay): not
shipped, built and cached on first use (~5 minutes on 2 cores)."""
LOG_EVERY = 100
PREFIX_STEPS = 40
"""Steps after which every build records the digest of its weights (:data:`PREFIX_FILE`)."""
PREFIX_FILE = "prefix-digest.json"


def weights_digest(model) -> str:
    """sha256 of a model's parameters and buffers: names, dtypes, shapes and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def prefix_recipe(recipe: WarmupRecipe) -> WarmupRecipe:
    """``recipe``'s first :data:`PREFIX_STEPS` steps (the same examples, seeds and schedule)."""
    return dataclasses.replace(recipe, steps=min(PREFIX_STEPS, recipe.steps))


def recipe_key(recipe: WarmupRecipe) -> str:
    import asyncrl.chat as chat
    import asyncrl.models.builtin as builtin
    import recipes.demo.sft_data as demo_sft
    import recipes.demo.task as demo_task
    import tools.calculator as calculator
    import tools.estimate as estimate
    import trainer_daemon.compute.portable_numerics as numerics
    import trainer_daemon.sft as sft

    h = hashlib.sha256()
    for mod in (builtin, chat, demo_sft, demo_task, calculator, estimate, numerics, sft):
        h.update(Path(mod.__file__).read_bytes())
    for asset in (builtin._TOKENIZER_JSON, builtin._CHAT_TEMPLATE):
        h.update(Path(asset).read_bytes())
    if recipe.base == MOE_DEMO.base:  # only its recipes: DEMO's key (the shipped policy's) stays as it is
        import asyncrl.models.builtin_moe as builtin_moe

        h.update(Path(builtin_moe.__file__).read_bytes())
    h.update(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode())
    return h.hexdigest()[:16]


def shipped_dir() -> Path:
    """Where the package ships :data:`DEMO`'s build (``python -m recipes.demo.warmup --ship``)."""
    import asyncrl.models

    return Path(asyncrl.models.__file__).parent / "assets" / DEMO.name


def shipped(recipe: WarmupRecipe) -> Path | None:
    """The shipped build of ``recipe``, when the package holds one made by the current code
    (its stamp is the recipe's key); None otherwise (another recipe, or code changed since)."""
    stamp = shipped_dir() / EXPORT_STAMP
    if recipe != DEMO or not stamp.is_file() or stamp.read_text().strip() != recipe_key(recipe):
        return None
    return shipped_dir()


def warm_up(recipe: WarmupRecipe = DEMO, progress: Callable[[str], None] = print, show_steps: bool = False,
            use_shipped: bool = True) -> Path:
    """The warmed-up model directory of ``recipe``: the package's shipped build when it is
    current (:func:`shipped`; ``use_shipped=False`` never takes it), else built and cached on
    first use. ``show_steps``: draw the SFT's progress on stderr (a bar on a terminal, else a
    line every 10 s: :class:`asyncrl.task_progress.TaskProgress`)."""
    from asyncrl.models.cache import build_once

    if use_shipped and (ready := shipped(recipe)) is not None:
        return ready
    if recipe == DEMO and use_shipped:
        progress(f"the package's {DEMO.name} was built by other code ({shipped_dir()}): building it here once")
    return build_once(cached_dir(recipe), lambda out: _build(recipe, out, progress, show_steps))


def cached_dir(recipe: WarmupRecipe) -> Path:
    """Where :func:`warm_up` builds and caches ``recipe`` (built once it holds ``COMPLETE``)."""
    from asyncrl.models.smollm2 import cache_dir

    return cache_dir() / "models" / f"{recipe.name}-{recipe_key(recipe)}"


def examples_of(recipe: WarmupRecipe, tokenizer):
    """``(chat tokenizer, SFT examples)`` of ``recipe``."""
    from asyncrl.chat import ChatTokenizer
    from recipes.demo.sft_data import demo_sft_examples
    from recipes.demo.task import ArithSpec
    from tools.registry import ToolRegistry

    chat = ChatTokenizer(tokenizer, ToolRegistry.from_names(list(recipe.tools)).schemas())
    spec = None if recipe.level is None else ArithSpec.level(recipe.level)
    return chat, demo_sft_examples(chat, recipe.examples, seed=recipe.seed, exact_fraction=recipe.exact_fraction, spec=spec)


def sft_config(recipe: WarmupRecipe):
    from trainer_daemon.sft import SftConfig

    return SftConfig(steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr, log_every=LOG_EVERY)


def _build(recipe: WarmupRecipe, out: Path, progress: Callable[[str], None], show_steps: bool = False) -> None:
    """Train ``recipe`` into ``out`` with portable numerics: in this process when it was
    started with them, else in a child process started with them (torch reads them at import:
    :mod:`trainer_daemon.compute.portable_numerics`). The child's progress lines reach ``progress``."""
    import subprocess

    from trainer_daemon.compute.portable_numerics import is_portable, portable_environ

    if is_portable():
        _train(recipe, out, progress, show_steps)
        return
    argv = [sys.executable, "-m", "recipes.demo.warmup", "--build-into", str(out),
            "--recipe", json.dumps(dataclasses.asdict(recipe)), *(["--show-steps"] if show_steps else [])]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=portable_environ()) as child:
        assert child.stdout is not None
        for line in child.stdout:
            progress(line.rstrip("\n"))
    if child.returncode != 0:
        raise RuntimeError(f"building {recipe.name} failed in its child process (exit {child.returncode}); "
                           "its error is on stderr above")


def _train(recipe: WarmupRecipe, out: Path, progress: Callable[[str], None], show_steps: bool = False,
           require_portable: bool = True) -> None:
    """Train ``recipe`` into ``out`` in this process (``require_portable``: refuse unless its
    torch took the portable pins; bench/portable_numerics.py turns that off to show the difference)."""
    import torch

    from asyncrl.models import load_model, load_tokenizer
    from asyncrl.task_progress import TaskProgress
    from trainer_daemon.compute.portable_numerics import check_torch_is_portable
    from trainer_daemon.sft import save_hf, sft

    if require_portable:
        check_torch_is_portable()
    progress(f"warming up {recipe.base} on the demo task ({recipe.steps} SFT steps, portable numerics, cached afterwards) ...")
    torch.manual_seed(0)
    tok = load_tokenizer(recipe.base)
    model = load_model(recipe.base)
    _chat, examples = examples_of(recipe, tok)
    prefix = prefix_recipe(recipe).steps
    digests: dict[str, object] = {}

    def on_step(step: int, loss: float) -> None:
        bar.advance(note=f"loss {loss:.3f}")
        if step == prefix:
            digests.update(steps=step, sha256=weights_digest(model))

    with TaskProgress(f"warm-up of {recipe.name}", total=recipe.steps, enabled=show_steps) as bar:
        losses = sft(model, examples, sft_config(recipe), tok.pad_token_id, on_step=on_step)
    save_hf(model, tok, out)
    (out / PREFIX_FILE).write_text(json.dumps(digests, sort_keys=True) + "\n")
    tail = losses[-20:]
    progress(f"warm-up done (final loss {sum(tail) / len(tail):.3f}): {out}")


EXPORT_STAMP = ".asyncrl-warmup-key"  # in an exported directory: the recipe key it was built from


def export(recipe: WarmupRecipe, dest: Path, progress: Callable[[str], None] = print, show_steps: bool = False,
           use_shipped: bool = True) -> Path:
    """Copy the warmed-up model of ``recipe`` to ``dest`` (a plain Hugging Face directory any
    component loads as ``model.path``), unless ``dest`` already holds this recipe's build.
    The copy is made beside ``dest`` and renamed into place, so a reader never sees half a
    model; an older build at ``dest`` is replaced."""
    import shutil
    import tempfile

    key = recipe_key(recipe)
    stamp = dest / EXPORT_STAMP
    if stamp.is_file() and stamp.read_text().strip() == key:
        progress(f"{dest} already holds {recipe.name} ({key})")
        return dest
    built = warm_up(recipe, progress, show_steps, use_shipped)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        shutil.copytree(built, tmp, dirs_exist_ok=True)
        (tmp / EXPORT_STAMP).write_text(key + "\n")
        for path in [tmp, *tmp.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"exported {recipe.name} to {dest}")
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.demo.warmup",
                                     description=f"Build {SPEC} (cached) and print its directory on stdout.")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--export", metavar="DIR", type=Path,
                        help="also copy it to DIR (skipped when DIR holds this build): compose's model-init")
    parser.add_argument("--ship", action="store_true",
                        help=f"build it from scratch and write it into the package ({shipped_dir()}), for a release")
    parser.add_argument("--rebuild", action="store_true",
                        help="build it from scratch into the cache even when the package ships it (to check the shipped build)")
    parser.add_argument("--prefix", action="store_true",
                        help=f"with --rebuild: only its first {PREFIX_STEPS} steps (their digest is in {PREFIX_FILE})")
    parser.add_argument("--moe", action="store_true",
                        help="the same warm-up of builtin:tiny-moe instead (a mixture-of-experts demo policy; built once, not shipped)")
    parser.add_argument("--build-into", type=Path, help=argparse.SUPPRESS)  # the child of _build
    parser.add_argument("--recipe", help=argparse.SUPPRESS)
    parser.add_argument("--show-steps", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.build_into:
        fields = json.loads(ns.recipe)
        recipe = WarmupRecipe(**{**fields, "tools": tuple(fields["tools"])})
        _train(recipe, ns.build_into, lambda message: print(message, flush=True), ns.show_steps)
        return 0

    def progress(message: str) -> None:
        if not ns.quiet:
            print(message, file=sys.stderr, flush=True)

    show = not ns.quiet
    if ns.moe:
        print(export(MOE_DEMO, ns.export, progress, show) if ns.export else warm_up(MOE_DEMO, progress, show), flush=True)
        return 0
    if ns.ship:
        print(export(DEMO, shipped_dir(), progress, show, use_shipped=False), flush=True)
        return 0
    if ns.rebuild:
        recipe = prefix_recipe(DEMO) if ns.prefix else DEMO
        print(warm_up(recipe, progress, show, use_shipped=False), flush=True)
        return 0
    print(export(DEMO, ns.export, progress, show) if ns.export else warm_up(DEMO, progress, show), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
