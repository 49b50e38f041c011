"""A service's background loops (asyncrl/loops.py): a loop or a periodic pass that raises is
logged with its name, counted and run again — never a silent death; a loop that returns is done;
stop ends them all, cancelling one that does not watch the stop event after the bound."""

from __future__ import annotations

import asyncio
import logging

from asyncrl.loops import LoopSupervisor
from tests.helpers.waiting import WAIT_S


async def until(predicate, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def test_a_periodic_pass_that_raises_costs_one_pass_not_the_loop(caplog):
    restarted: list[str] = []
    loops = LoopSupervisor("the test service", on_restart=restarted.append)
    passes = []

    async def body():
        passes.append(len(passes))
        if len(passes) in (1, 2):
            raise ConnectionError("NATS hiccup")

    with caplog.at_level(logging.ERROR):
        loops.every("metrics", 0.01, body)
        await until(lambda: len(passes) >= 5, "the periodic loop did not go on after its failing passes")
    await loops.stop()
    assert loops.restarts == {"metrics": 2} and restarted == ["metrics", "metrics"]
    assert "background loop 'metrics' of the test service died" in caplog.text and "NATS hiccup" in caplog.text


async def test_a_loop_that_raises_is_started_again_and_one_that_returns_is_done():
    loops = LoopSupervisor("the test service", restart_s=0.0)
    starts = {"crashy": 0, "once": 0}

    async def crashy(stop: asyncio.Event):
        starts["crashy"] += 1
        if starts["crashy"] < 3:
            raise RuntimeError("a bug")
        await stop.wait()

    async def once(_stop: asyncio.Event):
        starts["once"] += 1

    loops.spawn("crashy", crashy)
    done = loops.spawn("once", once)
    await until(lambda: starts["crashy"] == 3 and done.done(), "the loops did not settle")
    assert starts["once"] == 1 and loops.restarts == {"crashy": 2}
    await loops.stop()


async def test_stop_ends_every_loop_and_cancels_one_that_ignores_it():
    loops = LoopSupervisor("the test service")
    cancelled = asyncio.Event()

    async def deaf(_stop: asyncio.Event):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    polite = loops.every("polite", 3600, lambda: asyncio.sleep(0))
    deaf_task = loops.spawn("deaf", deaf)
    await asyncio.sleep(0.05)
    await loops.stop(timeout_s=0.2)
    assert polite.done() and deaf_task.done() and cancelled.is_set() and loops.stopping
