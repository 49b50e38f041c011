"""asyncrl/failpoints.py: a failpoint acts only while armed, says it was reached, holds until
released; ``hold_async`` holds a coroutine while the event loop runs on."""

from __future__ import annotations

import asyncio
import os

from asyncrl import failpoints


async def test_hold_async_holds_while_armed_and_the_loop_runs_on(tmp_path, monkeypatch):
    monkeypatch.setenv(failpoints.ENV_DIR, str(tmp_path))
    assert await failpoints.hold_async("x.place") is False, "not armed: no hold"
    (tmp_path / "x.place.arm").touch()
    held = asyncio.create_task(failpoints.hold_async("x.place"))
    ticks = 0
    while not failpoints.reached(tmp_path, "x.place"):
        await asyncio.sleep(0.01)
        ticks += 1
    assert failpoints.reached(tmp_path, "x.place") == [os.getpid()]
    for _ in range(5):  # the loop runs while it holds
        await asyncio.sleep(failpoints.POLL_S)
        ticks += 1
    assert not held.done()
    (tmp_path / "x.place.release").touch()
    assert await asyncio.wait_for(held, 5) is True
    assert ticks >= 5


async def test_unset_directory_is_production_no_hold(monkeypatch):
    monkeypatch.delenv(failpoints.ENV_DIR, raising=False)
    assert await failpoints.hold_async("x.place") is False
    assert failpoints.hold("x.place") is False
