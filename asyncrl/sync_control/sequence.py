"""One weight update from pause to release, in the one order the sync agent and the trainer's
direct publisher both run (LoRA adapters will reuse it):

    pause(mode) → [begin] → [form the group] → load every bucket → [end] → [check weights] → flush     release (finally)

:class:`UpdateSteps` holds what differs per caller: whether and how the group is formed, how
the buckets are loaded (the agent waits for the trainer's broadcast of each; the direct
publisher broadcasts them itself), where the caller hears of each phase, and how it contains a
failure. ``phase`` is called with ``awaiting_broadcast`` (members paused, sessions open),
``loading`` (group formed) and ``resuming`` (every bucket loaded, sessions closed).

On a failure at any step ``contain(error)`` runs *before* ``release`` continues the members,
so a caller quarantines members that may hold mixed weights (:meth:`EngineUpdate.outcome`)
while they are still paused; then the error propagates. ``release`` always runs: it ends a
session left open and continues the members paused here.

``session`` (default on): the begin/end weight-update session (SGLang 0.5.21+; a no-op on
older releases) around the load. An adapter sync turns it off: its load step only sets the
version (the adapter was loaded before the pause), and ``end_weight_update`` re-processes
every base weight after loading (``process_weights_after_loading``), a needless cost inside
the pause for quantized or MLA bases.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from asyncrl.sync_control.engine_update import EngineUpdate


async def _nothing(_: BaseException) -> None:
    return None


@dataclass
class UpdateSteps:
    load: Callable[[], Awaitable[None]]
    """Load every bucket (:meth:`EngineUpdate.load` per bucket)."""
    form: Callable[[], Awaitable[None]] | None = None
    """Form the weight-update group (None: the members are in it already)."""
    phase: Callable[[str], None] = field(default=lambda _: None)
    contain: Callable[[BaseException], Awaitable[None]] = _nothing
    """Called with the error before ``release`` (module docstring)."""
    session: bool = True
    """Open the begin/end weight-update session around the load (module docstring)."""


async def run_update(update: EngineUpdate, engine_mode: str, flush_retries: int, steps: UpdateSteps,
                     check_weights: bool = False) -> None:
    """The sequence of the module docstring; raises what a step raised, after ``contain``.
    ``check_weights`` (``sync.check_weights``): the members are asked whether they hold the same
    weights while still paused (:meth:`EngineUpdate.check_weights`)."""
    try:
        await update.pause(engine_mode)
        if steps.session:
            await update.begin()
        steps.phase("awaiting_broadcast")
        if steps.form is not None:
            await steps.form()
        steps.phase("loading")
        await steps.load()
        if steps.session:
            await update.end()
        if check_weights:
            await update.check_weights()
        steps.phase("resuming")
        await update.flush(flush_retries)
    except Exception as exc:  # a cancellation (shutdown) only releases
        await steps.contain(exc)
        raise
    finally:
        await update.release()
