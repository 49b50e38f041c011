"""Issue 48 items 7 and 9: numbers the product stores must be bounded where they enter.

- a completion's ``seed`` outside int64 was a 500 on every completion route: a 400 now;
- a trajectory's ``temperature`` was never checked (one NaN skipped every update of its step):
  the wire refuses a non-finite or negative one, as it refuses a bad reward;
- weight versions beyond int63 (a sync of version 2^70 was accepted and wedged every later
  sync): the sync request, the rollout's resume and the trajectory refuse them.
"""

from __future__ import annotations

import math
import random

import msgspec
import pydantic
import pytest

from asyncrl.wire import WireDecodeError, decode_trajectory, encode_trajectory
from asyncrl.wire.rollout_admin import ResumeRequest
from asyncrl.wire.sync import SyncRequest
from rollout_service.openai.schemas import ChatCompletionRequest, CompletionRequest
from tests.trainer.helpers import make_group

INT63 = 2**63 - 1


def _raw_with(**fields) -> bytes:
    traj = make_group(random.Random(0), "g", 2)[0]
    raw = msgspec.msgpack.decode(encode_trajectory(traj))
    raw.update(fields)
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -0.5])
def test_the_wire_refuses_a_temperature_that_is_not_finite_or_negative(temperature):
    with pytest.raises(WireDecodeError, match="temperature"):
        decode_trajectory(_raw_with(temperature=temperature))


def test_the_wire_refuses_versions_beyond_int63():
    with pytest.raises(WireDecodeError, match="int63"):
        decode_trajectory(_raw_with(version_start=0, version_end=2**64 - 1))  # msgpack's largest integer
    decode_trajectory(_raw_with(version_start=0, version_end=INT63))  # the largest is fine


def _version_refused(model, version: int) -> bool:
    try:
        model(version=version)
    except pydantic.ValidationError as exc:
        return any(e["loc"] == ("version",) for e in exc.errors())
    return False


@pytest.mark.parametrize("version", [2**63, 2**70])
def test_a_sync_or_resume_beyond_int63_is_refused(version):
    assert _version_refused(SyncRequest, version) and _version_refused(ResumeRequest, version)
    assert not _version_refused(SyncRequest, INT63) and not _version_refused(ResumeRequest, INT63)


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1])
def test_a_seed_outside_int64_is_refused_by_both_completion_routes(seed):
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "seed": seed}
    with pytest.raises(pydantic.ValidationError, match="seed"):
        ChatCompletionRequest.model_validate(chat)
    with pytest.raises(pydantic.ValidationError, match="seed"):
        CompletionRequest.model_validate({"model": "policy", "prompt": "hi", "seed": seed})
    assert ChatCompletionRequest.model_validate({**chat, "seed": -(2**63)}).seed == -(2**63)
