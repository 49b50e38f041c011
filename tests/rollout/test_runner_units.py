"""Units of the runner with in-memory collaborators (no NATS, no engines): its read model
(``Runner.snapshot``) follows its state through a partial pause and a resume while staying a
value, and ``restore`` sorts checkpoints into resumed and already-finished agents."""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest

from asyncrl.config import load_config
from rollout_service.agent.state import AgentState, Phase
from rollout_service.publish import Outbox, TrajectoryPublisher
from rollout_service.runner.finish import to_trajectory
from rollout_service.runner.quota import QueueDepth, StalenessQuota
from rollout_service.runner.restore import restore
from rollout_service.runner.runner import Runner, RunnerSettings
from rollout_service.runner.snapshot import RunnerSnapshot

WAIT_S = 10.0  # bound on every wait in this file


class Stream:
    produced, total, epoch, exhausted = 0, 8, 0, False

    def state_dict(self) -> dict:
        return {"produced": self.produced}

    def load_state_dict(self, state: dict) -> None:
        self.produced = state["produced"]


class AgentStore:
    def __init__(self, states=()) -> None:
        self.states, self.deleted, self.pending = list(states), [], 0

    async def load_all(self):
        return list(self.states)

    async def delete(self, trajectory_id: str) -> bool:
        self.deleted.append(trajectory_id)
        return True

    async def flush_dirty(self) -> int:
        return 0


class StateStore:
    def __init__(self, doc=None) -> None:
        self.doc = doc

    async def save(self, doc: dict) -> bool:
        self.doc = doc
        return True

    async def load(self):
        return self.doc


def _runner(tmp_path, aborts: list, on_abort, everything_only: bool = False) -> Runner:
    cfg = load_config(overrides=[f"run.dir={tmp_path}", "rollout.n=2", "actor.ppo_mini_batch_size=2"], environ={})
    outbox = Outbox(tmp_path / "outbox", 16)

    async def publish(subject, payload, headers):
        return None

    async def queue_probe() -> QueueDepth:
        return QueueDepth(0, 0)

    async def abort_engines(prefix: str, everything: bool = False) -> None:
        aborts.append((prefix, everything) if everything_only else prefix)
        if everything or not everything_only:
            on_abort()

    return Runner(RunnerSettings.from_config(cfg), deps=None, stream=Stream(), outbox=outbox,
                  publisher=TrajectoryPublisher(outbox, "subject", publish), agent_store=AgentStore(), state_store=StateStore(),
                  queue_probe=queue_probe, abort_engines=abort_engines, rid_prefix="rl-test.")


async def test_the_snapshot_follows_a_partial_pause_and_a_resume_and_stays_a_value(tmp_path):
    aborted = asyncio.Event()
    aborts: list[str] = []
    runner = _runner(tmp_path, aborts, aborted.set)
    before = runner.snapshot()
    assert isinstance(before, RunnerSnapshot)
    assert (before.version, before.paused, before.pause_mode, before.generating, before.admission_blocked) == (0, False, None, 0, None)

    async def generate_call() -> None:  # an engine request that ends when the pause aborts it
        with runner.calls.tracking():
            await aborted.wait()

    call = asyncio.create_task(generate_call())
    await asyncio.sleep(0)  # one loop turn: the task runs to its first await (deterministic, not a timed wait)
    assert runner.snapshot().generating == 1
    await asyncio.wait_for(runner.pause("partial", timeout_s=WAIT_S), WAIT_S)
    await asyncio.wait_for(call, WAIT_S)
    paused = runner.snapshot()
    assert aborts == ["rl-test."]
    assert (paused.paused, paused.pause_mode, paused.generating, paused.admission_blocked) == (True, "partial", 0, "paused (partial)")
    assert (runner.serving.paused, runner.serving.holding_calls) == (True, True), "the engine pool's view, written at the pause"
    assert (before.paused, before.generating) == (False, 0), "a snapshot taken earlier does not change"
    with pytest.raises(dataclasses.FrozenInstanceError):
        paused.paused = False  # type: ignore[misc]

    runner.counters.samples_started += 1
    runner.tokens.add(5, 5)
    await runner.resume(1)
    resumed = runner.snapshot()
    assert (resumed.version, resumed.quota.version, resumed.paused, resumed.pause_mode) == (1, 1, False, None)
    assert (runner.serving.version, runner.serving.paused, runner.serving.holding_calls) == (1, False, False)
    assert (resumed.counters.samples_started, resumed.tokens.decoded) == (1, 5)
    runner.counters.samples_started += 1
    runner.counters.finish_reasons["stop"] = 1
    assert resumed.counters.samples_started == 1 and resumed.counters.finish_reasons == {}, "nested parts are copies"


def _agent(group: str, i: int, phase: Phase = Phase.GENERATING) -> AgentState:
    return AgentState(id=f"run-{group}-{i}", run_id="run", group_id=group, group_size=2, group_index=i, prompt_id="p",
                      data_source="d", phase=phase, token_ids=[1, 2, 3], prompt_length=2, loss_mask=[1], logprobs=[-0.1],
                      versions=[0], finish_reason="stop" if phase == Phase.DONE else None)


async def test_restore_resumes_unfinished_agents_and_drops_those_already_in_the_outbox(tmp_path):
    outbox = Outbox(tmp_path / "outbox", 16)
    outbox.put_ready(to_trajectory(_agent("s1", 0, Phase.DONE), 0))  # finished just before the crash
    outbox.hold(to_trajectory(_agent("s2", 1, Phase.DONE), 0))  # its group mate s2-0 is still running
    outbox.hold(to_trajectory(_agent("s3", 0, Phase.DONE), 0))  # s3 had finished completely
    store = AgentStore([_agent("s1", 0), _agent("s1", 1), _agent("s2", 0)])
    stream, quota = Stream(), StalenessQuota(4, 4)
    doc = {"stream": {"produced": 3}, "quota": {"version": 2, "staleness_samples": 1, "started_this_version": 1,
                                                "carried_over_at_reset": 0}}
    got = await restore(state_store=StateStore(doc), agent_store=store, outbox=outbox, stream=stream, quota=quota)
    assert [s.id for s in got.agents] == ["run-s1-1", "run-s2-0"] and got.dropped == 1
    assert store.deleted == ["run-s1-0"] and got.groups == {"s1": 1, "s2": 1}
    assert (stream.produced, quota.version, quota.staleness_samples) == (3, 2, 1)
    assert set(outbox.held_ids()) == {"s2"}, "a group none of whose members still runs is released"
    assert [e.trajectory_id for e in outbox.ready_entries()] == ["run-s1-0", "run-s3-0"]


async def test_a_background_loop_that_raises_is_logged_and_restarted(tmp_path, monkeypatch, caplog):
    """Liveness: an unexpected exception in the admission loop must not stop admission for good
    (found at 1,024 agents: the loop died silently and the service stopped starting samples)."""
    from rollout_service.runner import runner as runner_module

    monkeypatch.setattr(runner_module, "LOOP_RESTART_S", 0.0)
    runner = _runner(tmp_path, [], lambda: None)
    runner.stream.exhausted = True  # nothing to admit: the loop only polls
    calls = {"n": 0}
    real_queue_probe = runner.queue_probe

    async def counting_probe() -> QueueDepth:  # called once per pass of the admission loop
        calls["n"] += 1
        return await real_queue_probe()

    failures = {"left": 1}
    real_blocker = runner.admission_blocker

    def blocker_raising_once(external: bool = False):  # a bug, as the outbox count that went negative
        if failures["left"]:
            failures["left"] -= 1
            raise ValueError("__len__() should return >= 0")
        return real_blocker(external)

    monkeypatch.setattr(runner, "admission_blocker", blocker_raising_once)
    runner.queue_probe = counting_probe
    await runner.start()
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while calls["n"] < 4:  # the probe runs once per loop pass: the loop is alive after the failure
        assert asyncio.get_running_loop().time() < deadline, "the admission loop did not come back"
        await asyncio.sleep(0.05)
    assert runner.counters.loop_restarts == 1
    assert "background loop 'admission' of the runner died" in caplog.text
    await runner.stop()


async def test_a_pause_whose_exact_aborts_are_used_up_aborts_everything_on_those_engines(tmp_path):
    """SGLang 0.5.20+ drops every exact-rid abort of a request after the first (issue 35 item
    2): a call whose first abort came before it was scheduled is never ended by re-sends. After
    ``EXACT_ABORT_ROUNDS`` rounds the pause aborts everything on the engines still holding one
    of its calls, and returns."""
    from rollout_service.runner.pause_modes import EXACT_ABORT_ROUNDS

    aborted = asyncio.Event()
    aborts: list = []
    runner = _runner(tmp_path, aborts, aborted.set, everything_only=True)  # exact aborts do nothing here

    async def generate_call() -> None:
        with runner.calls.tracking():
            await aborted.wait()

    call = asyncio.create_task(generate_call())
    await asyncio.sleep(0)
    await asyncio.wait_for(runner.pause("partial", timeout_s=WAIT_S), WAIT_S)
    await asyncio.wait_for(call, WAIT_S)
    assert aborts == [("rl-test.", False)] * EXACT_ABORT_ROUNDS + [("rl-test.", True)]


async def test_a_sample_cancelled_whole_gives_its_quota_place_back(tmp_path):
    """Issue 51: trajectories cancelled for staleness are published marked ``stale_cancelled``
    (never trained); once every member of the sample is, its place in the staleness quota is
    given back, and their decoded tokens are counted."""
    runner = _runner(tmp_path, [], lambda: None)
    runner.deps = types.SimpleNamespace(external=None)  # no external environments
    runner.quota.on_start()
    runner.groups["s1"] = 2
    before = runner.quota.staleness_samples
    for i in range(2):
        state = _agent("s1", i, Phase.DONE)
        state.cancelled, state.failure, state.finish_reason = "would lag 3", "stale_cancelled", "abort"
        await runner._finish(state)
        assert runner.quota.staleness_samples == (before if i == 0 else before - 1), "given back once the whole sample is"
    c = runner.snapshot().counters
    assert c.cancelled_samples == 1 and c.failures == {"stale_cancelled": 2} and c.stale_cancelled_tokens == 2
    assert len(runner.outbox.ready_entries()) == 2 and to_trajectory(state, 3).failure == "stale_cancelled"


async def test_in_flight_calls_estimate_what_a_call_has_decoded():
    """The per-request rule's inputs: a streamed call's count is exact; otherwise the estimate is
    the average rate of finished calls times the call's elapsed time, within its budget."""
    from rollout_service.runner.inflight import InFlightCalls

    calls = InFlightCalls()
    own = types.SimpleNamespace(id="own")
    calls.listen(lambda: None, lambda: None, own=lambda state: state is own)
    with calls.tracking("a", own, 100) as call:
        assert calls.decoded_estimate(call) == 0, "no finished call yet: no rate"
        call.started -= 2.0
        calls.finished(call, 50)  # 50 tokens in ~2 s
    assert calls.calls == {} and 20 < calls.decode_rate < 30
    with calls.tracking("b", None, 40) as call:
        assert calls.decoded_estimate(call, now=call.started + 1.0) in range(20, 31)
        assert calls.decoded_estimate(call, now=call.started + 100.0) == 40, "never beyond its budget"
        call.streamed = 7
        assert calls.decoded_estimate(call, now=call.started + 100.0) == 7


def test_expected_rest_of_a_turn_from_finished_lengths_and_the_projected_versions():
    from rollout_service.runner.inflight import TurnLengths
    from rollout_service.runner.per_request import projected_syncs

    turns = TurnLengths()
    assert turns.expected_remaining(10, 500) == 500, "no history: the whole budget"
    for n in (20, 40, 100, 1000):
        turns.add(n)
    assert turns.expected_remaining(0, 5000) == 290  # mean of every length
    assert turns.expected_remaining(50, 5000) == 500  # (50 + 950) / 2: a long turn goes on longer
    assert turns.expected_remaining(50, 300) == 300, "never beyond the budget"
    assert turns.expected_remaining(2000, 5000) == 2000, "beyond every length seen: as many again"
    assert projected_syncs(600, decode_rate=100.0, seconds_per_version=2.0) == 3  # 6 s of decoding, a version per 2 s
    assert projected_syncs(600, None, 2.0) == projected_syncs(600, 100.0, None) == 0, "unknown pace: judged at the sync"


async def test_a_call_kept_across_syncs_is_judged_from_the_version_it_was_sent_at():
    """A call kept in place across syncs returns nothing until it ends, so its agent has no
    token (``version_start`` None): its first token's version is the one served when it was
    sent, and a per-request pause judges it from there (found by bench/modes.py: such calls were
    judged from the current version and never cancelled)."""
    from asyncrl.sync_control.request_policy import RequestRule
    from rollout_service.runner.inflight import InFlightCalls
    from rollout_service.runner.per_request import call_facts, pause_per_request

    served = [0]
    calls = InFlightCalls(lambda: served[0])
    state = AgentState(id="a", run_id="r", group_id="g", group_size=1, group_index=0, prompt_id="p", data_source="d",
                       token_ids=[1, 2, 3], prompt_length=3, turn_start=3)
    aborted: list[set] = []

    async def abort(rids: set[str]) -> None:
        aborted.append(set(rids))

    with calls.tracking("rid-a", state, 100) as call:
        served[0] = 4  # three syncs later, the call still decoding
        assert call_facts(calls, call, current_version=4, now=call.started).start_version == 0
        out = await pause_per_request(calls, RequestRule(max_lag=3), target=4, current_version=4, abort_rids=abort,
                                      cancellable=lambda s: True, rounds=1, interval_s=0.0)
    assert out.cancelled == 1 and aborted == [{"rid-a"}] and "version 0" in state.cancelled


async def test_the_queue_ahead_counts_whole_samples_only(tmp_path):
    """Issue 51: the versions a finishing trajectory waits for are those of the whole samples
    queued ahead of it; the finished members of groups still decoding wait with it (counting
    them cancelled work the trainer would have taken in time on a trainer-bound long-context run)."""
    runner = _runner(tmp_path, [], lambda: None)  # n = 2, two samples per sync
    assert runner.settings.samples_per_sync == 2
    runner.queued_trajectories = 12
    assert runner.queue_versions() == 3, "six whole samples queued: three versions ahead"
    runner.groups.update({"s7": 1, "s8": 1})  # two groups with one member finished (queued), one decoding
    assert runner.queue_versions() == 2
    runner.groups["s9"] = 2  # a group with nothing finished yet changes nothing
    assert runner.queue_versions() == 2


def test_the_trainer_starves_only_with_the_quota_used_and_nothing_in_flight_queued_or_a_step_held(tmp_path):
    """``Runner.trainer_starving`` (issue 65): n = 2, a step of two samples (4 trajectories)."""
    runner = _runner(tmp_path, [], lambda: None)
    assert runner.settings.required_samples * runner.n == 4
    assert not runner.trainer_starving  # the quota has room: nothing to relieve
    runner.quota.staleness_samples = runner.quota.max_required_samples
    assert runner.trainer_starving  # nothing anywhere, the quota used up
    runner.trainer_held = 3  # less than a step held: it cannot train
    assert runner.trainer_starving
    runner.trainer_held = 4  # a step held: it trains, a version comes
    assert not runner.trainer_starving
    runner.trainer_held, runner.queued_trajectories = 0, 1  # a trajectory on its way
    assert not runner.trainer_starving
    runner.queued_trajectories, runner.groups["s00000000"] = 0, 1  # a sample in flight
    assert not runner.trainer_starving


async def test_only_the_services_own_calls_teach_the_decode_rate_and_a_few_outliers_do_not_move_it():
    """Issue 67 M1: 40 one-token calls of a data-plane client with long prompts (stateless: no
    agent state; or a session's) took the rate from 82 to 0.13 tok/s, and the per-request rule
    then cancelled the service's own calls as hopelessly behind. Through the runner's generator
    (the path every call takes): such calls leave the rate and the turn lengths as they were;
    the service's own calls set them, and a few slow ones among many do not drag the median."""
    from rollout_service.runner.inflight import InFlightCalls

    class Engines:
        def __init__(self) -> None:
            self.delay, self.tokens = 0.0, 1

        async def generate(self, state, ids, params, rid, extra=None):
            await asyncio.sleep(self.delay)
            return types.SimpleNamespace(output_ids=[1] * self.tokens, aborted=False)

    own = {f"a{i}": types.SimpleNamespace(id=f"a{i}", token_ids=[1, 2], turn_start=2) for i in range(20)}
    calls = InFlightCalls()
    calls.listen(lambda: None, lambda: None, own=lambda state: state is not None and own.get(getattr(state, "id", None)) is state)
    engines = Engines()
    gen = calls.routed(engines)
    engines.tokens = 40
    for state in list(own.values())[:10]:
        await gen.generate(state, [1, 2], {"max_new_tokens": 64}, f"rid-{state.id}")
    learnt, turns = calls.decode_rate, list(calls.turns.lengths)
    assert learnt is not None and learnt > 1000 and turns == [40] * 10
    engines.tokens, engines.delay = 1, 0.05  # a client's burst: one token each, slow (long prompts)
    session = types.SimpleNamespace(id="sess-x", token_ids=[1], turn_start=1)  # a session's state is not the runner's
    await asyncio.gather(*(gen.generate(None if i % 2 else session, [1] * 4000, {"max_new_tokens": 1}, f"c{i}")
                           for i in range(40)))
    assert calls.decode_rate == learnt and list(calls.turns.lengths) == turns, "a client's calls taught the rate"
    for state in list(own.values())[10:13]:  # three slow own calls among ten fast ones
        await gen.generate(state, [1, 2], {"max_new_tokens": 64}, f"rid-{state.id}")
    assert calls.decode_rate > learnt / 2, "three outliers among thirteen moved the median"
