"""The verifiers driver's plan and progress file (rollout_service/verifiers_env/plan.py): which
row each group plays, and what a restarted driver continues from."""

from __future__ import annotations

import random

import pytest

from rollout_service.verifiers_env.plan import GroupPlan, Progress


def test_groups_visit_every_row_once_per_epoch_in_the_prompt_streams_order():
    plan = GroupPlan(rows=5, total_epochs=3, shuffle=True, seed=7)
    assert plan.total == 15
    for epoch in range(3):
        rows = [plan.row(g) for g in range(epoch * 5, epoch * 5 + 5)]
        expected = list(range(5))
        random.Random(7 * 2**32 + epoch).shuffle(expected)  # the rollout service's own stream rule
        assert rows == expected
    assert [GroupPlan(rows=4, shuffle=False).row(g) for g in range(4)] == [0, 1, 2, 3]
    with pytest.raises(IndexError):
        plan.row(15)


def test_total_groups_caps_the_plan_and_an_empty_dataset_is_refused():
    assert GroupPlan(rows=10, total_epochs=2, total_groups=7).total == 7
    assert GroupPlan(rows=3, total_epochs=2, total_groups=100).total == 6
    with pytest.raises(ValueError, match="no rows"):
        GroupPlan(rows=0)


def test_progress_round_trips_and_refuses_another_plan(tmp_path):
    path = tmp_path / "progress.json"
    plan = GroupPlan(rows=4, seed=1)
    p = Progress.load_or_new(path, "env-a", plan, n=2)
    assert (p.started, p.total, p.done) == (0, 4, False) and Progress.read(path) is None
    p.started, p.open_sessions = 3, {"sess-1": "tok"}
    p.save(path)
    again = Progress.load_or_new(path, "env-a", plan, n=2)
    assert (again.started, again.open_sessions) == (3, {"sess-1": "tok"})
    for env_id, other, n in (("env-b", plan, 2), ("env-a", GroupPlan(rows=5, seed=1), 2), ("env-a", plan, 4)):
        with pytest.raises(ValueError, match="another plan"):
            Progress.load_or_new(path, env_id, other, n)
    path.write_text("{torn")
    assert Progress.read(path) is None
