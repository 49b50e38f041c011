"""How long rank 0 waits for data between two commands (issue 33): the idle poll normally;
only ``RETRY_CHECK_S`` while a sync is in flight (its failure is seen at the next command,
not after a whole idle poll) and after a failed one (the push the engines wait for goes first)."""

from __future__ import annotations

from types import SimpleNamespace

from trainer_daemon.rank0 import RETRY_CHECK_S, Rank0Services


def wait_s(sync) -> float:
    return Rank0Services.data_wait_s(SimpleNamespace(sync=sync), 2.0)


def test_the_wait_for_data_is_short_only_around_a_sync():
    assert RETRY_CHECK_S < 2.0
    assert wait_s(None) == 2.0  # no sync configured
    assert wait_s(SimpleNamespace(in_flight=False, last_failed=False)) == 2.0
    assert wait_s(SimpleNamespace(in_flight=True, last_failed=False)) == RETRY_CHECK_S
    assert wait_s(SimpleNamespace(in_flight=False, last_failed=True)) == RETRY_CHECK_S
