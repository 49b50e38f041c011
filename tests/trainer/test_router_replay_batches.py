"""Issue 53: a trajectory's routes in the trainer — admitted only when they fit the policy
(dead-letter reasons on fixed trajectories), laid out as the micro-batch's ``input_ids``
(padded and packed), and a step under R3 replays them: the flip rate is 0 when the routes are
the policy's own and its update equals the plain step's; positive when they are another's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.wire import RoutedExperts, Trajectory
from trainer_daemon.compute.batch import collate
from trainer_daemon.compute.packing import pack
from trainer_daemon.consume.admission import PolicyRouting, admission_check

WORKER = str(Path(__file__).with_name("replay_worker.py"))
ROOT = str(Path(__file__).resolve().parents[2])
MOE = PolicyRouting(layers=4, top_k=2, experts=8, replay=True)


def traj(n: int = 6, routes: np.ndarray | None = None, failure: str = "", tid: str = "t") -> Trajectory:
    r = None if routes is None else RoutedExperts(layers=routes.shape[1], top_k=routes.shape[2], width=1,
                                                  rows=routes.astype("<u1").tobytes())
    return Trajectory(id=tid, run_id="run", group_id="g", group_size=1, group_index=0, prompt_id="p", data_source="d",
                      token_ids=list(range(1, n + 1)), prompt_length=2, loss_mask=[1] * (n - 2),
                      rollout_logprobs=[-0.5] * (n - 2), weight_versions=[0] * (n - 2), failure=failure, routed_experts=r)


def rows(n: int, layers: int = 4, top_k: int = 2, value: int = 3) -> np.ndarray:
    out = np.full((n, layers, top_k), value)
    out[:, :, 1] = (value + 1) % 8
    return out


@pytest.mark.parametrize(("t", "routing", "reason"), [
    (traj(), MOE, "no routed_experts"),
    (traj(failure="engine_error"), MOE, ""),  # never trained: no routes needed
    (traj(routes=rows(5)), PolicyRouting(layers=4), "dense policy"),
    (traj(routes=rows(5, layers=3)), MOE, "3 layers x top-2"),
    (traj(routes=rows(5, value=9)), MOE, "expert id 9"),
    (traj(routes=rows(5)), MOE, ""),
    (traj(routes=rows(5)), PolicyRouting(layers=4, top_k=2, experts=8), ""),  # replay off: kept, unused
    (traj(routes=np.full((5, 4, 2), 255)), MOE, ""),  # every row unreported: routed live, not out of range
    # a layer's top-k naming one expert twice (issue 67): its replay would weight that expert twice
    (traj(routes=np.concatenate([rows(2), np.full((1, 4, 2), 255), np.where(np.arange(4)[None, :, None] == 2, 5, rows(2))])),
     MOE, "repeats an expert within layer 2's top-2 (row 3)"),
])
def test_routes_that_do_not_fit_the_policy_are_refused_with_a_reason(t, routing, reason):
    got = admission_check("run", 2000, 64, routing)(t)
    assert (reason in got and got) if reason else got == "", got


def test_routes_follow_input_ids_in_padded_and_packed_micro_batches():
    a = traj(6, routes=rows(5, value=1), tid="a")
    b = traj(4, routes=rows(3, value=5), tid="b")
    padded = collate([a, b], [0, 1], [1.0, 1.0], pad_id=0)
    r = padded.routes.view(2, 6, 4, 2)
    assert r[0, :5, 0, 0].tolist() == [1] * 5 and r[0, 5].eq(-1).all(), "the last position routes live"
    assert r[1, :3, 0, 0].tolist() == [5] * 3 and r[1, 3:].eq(-1).all(), "and so does padding"
    packed = pack([a, b], [0, 1], [1.0, 1.0], pad_id=0)
    assert packed.routes.shape == (10, 4, 2)
    assert packed.routes[:, 0, 0].tolist() == [1, 1, 1, 1, 1, -1, 5, 5, 5, -1]
    assert collate([traj(), traj()], [0, 1], [1.0, 1.0], pad_id=0).routes is None
    unreported = rows(5, value=2)
    unreported[3:] = 255  # no route: environment tokens after the last call
    routed = pack([traj(6, routes=unreported)], [0], [1.0], pad_id=0).routes
    assert routed.dtype == torch.int16 and routed[:, 0, 0].tolist() == [2, 2, 2, -1, -1, -1]


def test_a_step_replays_the_routes_it_is_given(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, WORKER, str(tmp_path / "out.pt")], env=env, capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    own, other, plain = got["own"], got["other"], got["plain"]
    assert own["metrics"]["actor/router_replay/flip_rate"] == 0.0, "the policy's own routes: no flip"
    assert torch.allclose(own["update"], plain["update"], rtol=0, atol=1e-6), "and the plain step's update"
    assert other["metrics"]["actor/router_replay/flip_rate"] > 0.9, "routes of other experts: flips"
    assert not torch.allclose(other["update"], plain["update"], atol=1e-4)
    assert "actor/router_replay/flip_rate" not in plain["metrics"]
