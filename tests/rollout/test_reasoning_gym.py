"""reasoning-gym tasks as a run's dataset (``data.source``): the rows, the files, the reward by
the task's own verifier, the options reaching the generator, and the errors a user can make.
Expected answers and scores are taken from reasoning-gym directly in the test, not through
asyncrl's code."""

from __future__ import annotations

import json

import pytest
import reasoning_gym

from asyncrl.config import load_config
from asyncrl.config.loader import ConfigError
from rollout_service.data import load_records
from rollout_service.data.reasoning_gym_task import TaskConfigError, rows, write_dataset
from rollout_service.prompts import build_prompt_stream, source_reward, validation_records
from rollout_service.rewards import RewardRegistry

OPTIONS = {"min_terms": 2, "max_terms": 2, "max_digits": 2}


def cfg_for(tmp_path, *extra: str):
    return load_config(overrides=[f"run.dir={tmp_path / 'run'}", "data.source=reasoning_gym:basic_arithmetic",
                                  f"data.source_options={json.dumps(OPTIONS)}", "data.source_size=40",
                                  "data.source_val_size=8", "data.seed=3", *extra], environ={})


def test_rows_are_the_tasks_problems_in_verls_layout():
    got = rows("basic_arithmetic", OPTIONS, 20, 3, "train")
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=20, seed=3, **OPTIONS)
    assert len(got) == 20
    for i, row in enumerate(got):
        entry = ds[i]
        assert row["prompt"][-1] == {"role": "user", "content": entry["question"]}
        assert row["prompt"][0]["role"] == "system" and "<answer>" in row["prompt"][0]["content"]
        assert row["data_source"] == "reasoning_gym/basic_arithmetic"
        assert row["reward_model"]["ground_truth"] == entry["answer"] and row["extra_info"] == {"split": "train", "index": i}
        assert entry["metadata"]["num_terms"] == 2  # the options reached the generator


def test_files_are_written_once_per_setting_and_read_as_records(tmp_path):
    cfg = cfg_for(tmp_path)
    train, val = write_dataset(tmp_path, "basic_arithmetic", OPTIONS, 40, 8, 3)
    first = train.read_text()
    assert write_dataset(tmp_path, "basic_arithmetic", OPTIONS, 40, 8, 3) == (train, val) and train.read_text() == first
    other, _ = write_dataset(tmp_path, "basic_arithmetic", {**OPTIONS, "max_digits": 3}, 40, 8, 3)
    assert other.parent != train.parent, "a changed option never reuses old files"
    records, _ = load_records([str(train)])
    assert len(records) == 40 and records[0].data_source == "reasoning_gym/basic_arithmetic"
    stream = build_prompt_stream(cfg.data, cfg.rollout, cfg.run_dir, _Chat())
    assert stream.num_records == 40
    val_records = validation_records(cfg.data, cfg.run_dir)
    assert len(val_records) == 8 and {r.extra_info["split"] for r in val_records} == {"val"}
    assert validation_records(cfg_for(tmp_path, "data.source_val_size=0").data, tmp_path / "run") == []


async def test_the_reward_is_the_tasks_own_verifier(tmp_path):
    cfg = cfg_for(tmp_path)
    key, fn = source_reward(cfg.data)
    registry = RewardRegistry()
    registry.register(key, fn)
    train = reasoning_gym.create_dataset("basic_arithmetic", size=40, seed=3, **OPTIONS)
    val = reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=4, **OPTIONS)
    for split, ds in (("train", train), ("val", val)):
        for i in (0, 5):
            entry = ds[i]
            info = {"split": split, "index": i}
            right = await registry.score(key, f"Thinking... <answer>{entry['answer']}</answer>", entry["answer"], info)
            assert right.score == ds.score_answer(answer=entry["answer"], entry=entry) == 1.0 and not right.failed
            wrong_answer = str(int(entry["answer"]) + 1)
            wrong = await registry.score(key, f"<answer>{wrong_answer}</answer>", entry["answer"], info)
            assert wrong.score == ds.score_answer(answer=wrong_answer, entry=entry) < 1.0
            missing = await registry.score(key, f"the answer is {entry['answer']}", entry["answer"], info)
            assert missing.score == 0.0 and missing.details["answer"] == ""
    bad = await registry.score(key, "<answer>1</answer>", "1", {"split": "train", "index": 40})
    assert bad.failed and "names no generated problem" in bad.details["error"]


async def test_without_a_tag_the_last_number_counts_only_when_asked(tmp_path):
    """``data.source_answer = "tag_or_last_number"``: a tagless response is judged on its last
    number (by the task's own verifier); a tag still wins when there is one."""
    key, fn = source_reward(cfg_for(tmp_path, "data.source_answer=tag_or_last_number").data)
    registry = RewardRegistry()
    registry.register(key, fn)
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=40, seed=3, **OPTIONS)
    entry, info = ds[2], {"split": "train", "index": 2}
    wrong = str(int(entry["answer"]) + 1)
    plain = await registry.score(key, f"{entry['question']} It is {wrong}, no: {entry['answer']}.", entry["answer"], info)
    assert plain.score == 1.0 and plain.details["answer_from"] == "last_number" and plain.details["answer"] == entry["answer"]
    tagged = await registry.score(key, f"<answer>{wrong}</answer> but maybe {entry['answer']}", entry["answer"], info)
    assert tagged.score == ds.score_answer(answer=wrong, entry=entry) < 1.0 and tagged.details["answer_from"] == "tag"
    nothing = await registry.score(key, "no idea", entry["answer"], info)
    assert nothing.score == 0.0 and nothing.details["answer_from"] == "none"
    _key, strict = source_reward(cfg_for(tmp_path).data)  # the default: reasoning-gym's own rule, a tag or nothing
    assert strict(f"it is {entry['answer']}", entry["answer"], info).score == 0.0


def test_configuration_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="data.source: String should match pattern .*reasoning_gym"):
        load_config(overrides=["data.source=basic_arithmetic"], environ={})
    with pytest.raises(TaskConfigError, match="no dataset 'basic_arithmetics'"):
        rows("basic_arithmetics", {}, 2, 0, "train")
    with pytest.raises(TaskConfigError, match="refused data.source_options.*bogus"):
        rows("basic_arithmetic", {"bogus": 1}, 2, 0, "train")
    with pytest.raises(TaskConfigError, match="max_terms must be >= min_terms"):
        rows("basic_arithmetic", {"min_terms": 5, "max_terms": 2}, 2, 0, "train")


class _Chat:
    """Prompt lengths for the stream's length filter (the real tokenizer is not needed here)."""

    def prompt_ids(self, messages) -> list[int]:
        return [0] * sum(len(m["content"]) // 4 for m in messages)


async def test_a_service_trains_on_a_reasoning_gym_task_end_to_end(tmp_path, nats_server, warm_engine, warm_model):
    """The rollout service with ``data.source``: prompts from the task, each trajectory scored by
    the task's verifier (the untrained model rarely answers: the score is whatever the verifier
    says of its text, recomputed here from reasoning-gym directly)."""
    from rollout_service.prompts import source_files
    from tests.rollout.conftest import running_service, service_config
    from tests.rollout.test_service_episodes import fetch_all

    opts = json.dumps(OPTIONS)
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "data.source=reasoning_gym:basic_arithmetic",
                         f"data.source_options={opts}", "data.source_size=40", "data.source_val_size=0", "data.seed=3",
                         "rollout.n=2", "rollout.total_rollout_steps=2", "rollout.sampling.max_new_tokens=24",
                         "rollout.tools=[]")
    async with running_service(cfg):
        trajs = await fetch_all(nats_server.url, cfg.run.id, 4)
    train = load_records(source_files(cfg.data, cfg.run_dir)[0])[0]
    ds = reasoning_gym.create_dataset("basic_arithmetic", size=40, seed=3, **OPTIONS)
    from reasoning_gym.utils import extract_answer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(warm_model))
    for t in trajs:
        assert t.data_source == "reasoning_gym/basic_arithmetic" and not t.failure, t.failure
        record = next(r for r in train if r.prompt_id == t.prompt_id)
        entry = ds[record.extra_info["index"]]
        assert entry["question"] in tok.decode(t.token_ids[:t.prompt_length])
        model_tokens = [x for x, m in zip(t.token_ids[t.prompt_length:], t.loss_mask, strict=True) if m]
        answer = extract_answer(tok.decode(model_tokens, skip_special_tokens=True))
        want = 0.0 if answer is None else ds.score_answer(answer=answer, entry=entry)
        assert t.reward == want and t.reward_details["rg_score"] == want
