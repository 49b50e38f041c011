"""Generate calls in flight through the runner — what a pause waits on and decides over.

Every generate call of the service (internal agents, OpenAI requests, streamed or not) goes
through :meth:`InFlightCalls.routed`'s generator, which registers it (:class:`InFlightCall`:
its rid, its agent's state, its token budget, when it started) while it is at an engine.
A partial pause closes the gate, aborts the service's requests and returns once the count
is zero; a per-request pause (:mod:`.per_request`) decides over the registered calls; the
version clock treats the runner as busy while the count is above zero.

Tokens a call has decoded so far: exact for a streamed call (its last chunk), otherwise
estimated from its elapsed time at the service's recent decode rate per call
(:meth:`InFlightCalls.decoded_estimate`: a non-streamed ``/generate`` shows nothing until it
returns). The rate is the median, over the last :data:`RATES_KEPT` finished calls of the
service's *own* agents, of their tokens per second of the call's whole duration (queueing and
prefill included), so it under-estimates. Only the service's own agents feed it and the turn
lengths (issue 67 M1): a data-plane client's calls (stateless OpenAI calls, sessions) are
counted and registered but teach nothing, so a burst of one-token calls with long prompts
cannot drag the rate down and make the per-request rule cancel the service's work; the median
bounds what a few outliers among the service's own calls can do.

Not covered: requests sent to an engine by anything else (the sync agent, other services).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

RATES_KEPT = 64  # finished own calls whose rates the decode-rate median reads
LENGTHS_KEPT = 1024  # finished turns whose lengths the expected-remaining estimate reads


class TurnLengths:
    """Lengths (model tokens) of the last :data:`LENGTHS_KEPT` assistant turns that finished
    (not aborted), for the expected rest of a turn in flight: the mean of ``L - d`` over the
    lengths ``L`` longer than the ``d`` tokens it already has (a long-tail distribution makes
    a long turn likely to go on longer), within its budget. With no history: the budget; a
    turn longer than every length seen: as many again as it has."""

    def __init__(self, keep: int = LENGTHS_KEPT) -> None:
        self.lengths: deque[int] = deque(maxlen=keep)

    def add(self, n: int) -> None:
        if n > 0:
            self.lengths.append(n)

    def expected_remaining(self, decoded: int, budget: int) -> int:
        budget = max(0, budget)
        if not self.lengths:
            return budget
        longer = [n - decoded for n in self.lengths if n > decoded]
        if not longer:
            return min(budget, max(1, decoded))
        return min(budget, round(sum(longer) / len(longer)))


@dataclass
class InFlightCall:
    """One generate call at an engine."""

    rid: str
    state: Any
    """The agent state it decodes for (``rollout_service.agent.state.AgentState``)."""
    max_new: int
    """Its ``max_new_tokens``."""
    started: float
    """``time.monotonic()`` when it was sent."""
    version: int = 0
    """The weight version served when it was sent: the version of its first token when its
    agent has none yet (a call kept across syncs returns nothing until it ends)."""
    streamed: int | None = None
    """Tokens its stream has shown so far (None: not streamed, or nothing yet)."""


class InFlightCalls:
    """Built before the runner and the agents' dependencies (both use it); the runner listens
    (:meth:`listen`) when it is built."""

    def __init__(self, served_version: Callable[[], int] = lambda: 0) -> None:
        """``served_version()``: the weight version served now (``ServingState.version``)."""
        self.served_version = served_version
        self.count = 0
        self.calls: dict[str, InFlightCall] = {}
        """The registered calls by rid (a call without a rid is counted, not registered)."""
        self._rates: deque[float] = deque(maxlen=RATES_KEPT)
        self.turns = TurnLengths()
        """Lengths of finished turns of the service's own agents (:class:`TurnLengths`)."""
        self._on_busy: Callable[[], None] = lambda: None
        self._on_idle: Callable[[], None] = lambda: None
        self._own: Callable[[Any], bool] = lambda state: False

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second of one call: the median over the service's own recent finished
        calls (module docstring; None: none yet)."""
        return statistics.median(self._rates) if self._rates else None

    @decode_rate.setter
    def decode_rate(self, rate: float | None) -> None:
        """Forget what was learnt (None), or start again from ``rate`` (tests drive states)."""
        self._rates.clear()
        if rate is not None:
            self._rates.append(rate)

    def listen(self, on_busy: Callable[[], None], on_idle: Callable[[], None],
               own: Callable[[Any], bool] = lambda state: False) -> None:
        """``on_busy`` runs when a call starts, ``on_idle`` when the count falls back to zero;
        ``own(state)``: whether a call's agent state is one of the service's own agents (only
        those feed the rate and the turn lengths)."""
        self._on_busy, self._on_idle, self._own = on_busy, on_idle, own

    @contextlib.contextmanager
    def tracking(self, rid: str | None = None, state: Any = None, max_new: int = 0) -> Iterator[InFlightCall | None]:
        """Count (and with a ``rid``, register) one call for the duration of the block."""
        call = None
        if rid is not None:
            call = self.calls[rid] = InFlightCall(rid, state, max_new, time.monotonic(), self.served_version())
        self.count += 1
        self._on_busy()
        try:
            yield call
        finally:
            self.count -= 1
            if call is not None and self.calls.get(rid) is call:
                del self.calls[rid]
            if self.count == 0:
                self._on_idle()

    def finished(self, call: InFlightCall | None, tokens: int, turn_length: int | None = None, state: Any = None) -> None:
        """A call of agent ``state`` (``call.state`` when registered) returned ``tokens`` new
        tokens: its rate joins :attr:`decode_rate`'s window and ``turn_length`` (the model
        tokens of the turn it ended; None: aborted, or no turn) the turn lengths — only for the
        service's own agents (module docstring)."""
        if not self._own(call.state if call is not None else state):
            return
        if turn_length is not None:
            self.turns.add(turn_length)
        if call is None or tokens <= 0:
            return
        self._rates.append(tokens / max(1e-3, time.monotonic() - call.started))

    def decoded_estimate(self, call: InFlightCall, now: float | None = None) -> int:
        """Tokens ``call`` has decoded by ``now`` (module docstring), within ``[0, max_new]``."""
        if call.streamed is not None:
            return min(call.streamed, call.max_new)
        if self.decode_rate is None:
            return 0
        elapsed = (time.monotonic() if now is None else now) - call.started
        return max(0, min(call.max_new, int(self.decode_rate * elapsed)))

    def routed(self, engines) -> _Counted:
        """A :class:`~rollout_service.agent.deps.Generator` over ``engines`` (the pool) that
        registers its calls here."""
        return _Counted(engines, self)


class _Counted:
    def __init__(self, engines, calls: InFlightCalls) -> None:
        self.engines, self.calls = engines, calls

    async def generate(self, state, input_ids: list[int], sampling_params: dict, rid: str, extra: dict | None = None) -> Any:
        with self.calls.tracking(rid, state, int(sampling_params.get("max_new_tokens", 0))) as call:
            before = _turn_so_far(state)
            res = await self.engines.generate(state, input_ids, sampling_params, rid, extra)
            self.calls.finished(call, len(res.output_ids), _turn_length(before, res))
            return res

    async def generate_stream(self, state, input_ids: list[int], sampling_params: dict, rid: str,
                              extra: dict | None = None) -> AsyncIterator[Any]:
        with self.calls.tracking(rid, state, int(sampling_params.get("max_new_tokens", 0))) as call:
            before, last = _turn_so_far(state), None
            async with contextlib.aclosing(self.engines.generate_stream(state, input_ids, sampling_params, rid, extra)) as results:
                async for res in results:
                    if call is not None:
                        call.streamed = len(res.output_ids)
                    last = res
                    yield res
            if last is not None and last.finish_reason is not None:
                self.calls.finished(None, 0, _turn_length(before, last), state)


def _turn_so_far(state) -> int | None:
    """Model tokens the state's current turn holds before a call (None: no agent state)."""
    return None if state is None else max(0, len(state.token_ids) - state.turn_start)


def _turn_length(before: int | None, res) -> int | None:
    """The turn's length when ``res`` ended it (not aborted), else None."""
    if before is None or res.aborted:
        return None
    return before + len(res.output_ids)
