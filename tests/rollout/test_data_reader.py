"""Readers of verl-layout prompt files: malformed rows are reported with file and line and
skipped; JSONL and Parquet give the same records; bad paths fail up front."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_service.data import (
    DataFileError,
    PromptStream,
    RowError,
    iter_records,
    load_records,
    read_validation_set,
)


def good_row(i: int, **over) -> dict:
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + 1?"}],
        "data_source": "unit/test",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i, "split": "train"},
        "ability": "math",
    }
    row.update(over)
    return row


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path


# (raw line, expected kind). Each goes on line 3 of a file whose other lines are valid.
MALFORMED = {
    "truncated_json": ('{"prompt": [{"role": "user", "content": "hi"}', "bad_json"),
    "not_an_object": ("[1, 2, 3]", "bad_json"),
    "missing_prompt": (json.dumps({k: v for k, v in good_row(9).items() if k != "prompt"}), "missing_field"),
    "prompt_is_string": (json.dumps(good_row(9, prompt="What is 2+2?")), "wrong_type"),
    "empty_messages": (json.dumps(good_row(9, prompt=[])), "empty_prompt"),
    "bad_role": (json.dumps(good_row(9, prompt=[{"role": "wizard", "content": "x"}])), "bad_role"),
    "content_not_str": (json.dumps(good_row(9, prompt=[{"role": "user", "content": 42}])), "bad_message"),
    "message_not_obj": (json.dumps(good_row(9, prompt=["hello"])), "bad_message"),
    "missing_role": (json.dumps(good_row(9, prompt=[{"content": "x"}])), "bad_message"),
    "data_source_int": (json.dumps(good_row(9, data_source=7)), "wrong_type"),
    "missing_data_source": (json.dumps({k: v for k, v in good_row(9).items() if k != "data_source"}), "missing_field"),
    "extra_info_list": (json.dumps(good_row(9, extra_info=[1])), "wrong_type"),
    "reward_model_str": (json.dumps(good_row(9, reward_model="5")), "wrong_type"),
    "no_ground_truth": (json.dumps(good_row(9, reward_model={"style": "rule"})), "missing_field"),
    "index_float": (json.dumps(good_row(9, extra_info={"index": 1.5})), "wrong_type"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_jsonl_row_is_reported_with_file_and_line_and_skipped(tmp_path: Path, case: str) -> None:
    raw, kind = MALFORMED[case]
    path = write_jsonl(tmp_path / "train.jsonl", [good_row(0), good_row(1), raw, good_row(3)])
    errors: list[RowError] = []
    records, stats = load_records([path], on_error=errors.append)
    assert [r.prompt_id for r in records] == ["0", "1", "3"]
    assert len(errors) == 1 and stats.malformed == 1 and stats.records == 3 and stats.rows == 4
    err = errors[0]
    assert (err.file, err.line, err.unit, err.kind) == (str(path), 3, "line", kind)
    assert f"{path}:line 3" in str(err)
    assert stats.malformed_by_kind == {kind: 1}


def test_invalid_utf8_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        json.dumps(good_row(0)).encode() + b"\n\n   \n" + b'{"prompt": "\xff\xfe"}\n' + json.dumps(good_row(4)).encode() + b"\n"
    )
    errors: list[RowError] = []
    records, stats = load_records(path, on_error=errors.append)
    assert [r.prompt_id for r in records] == ["0", "4"]
    assert [(e.line, e.kind) for e in errors] == [(4, "bad_json")]
    assert stats.rows == 3  # blank lines are not rows


def test_record_fields_and_fallback_prompt_id(tmp_path: Path) -> None:
    no_index = good_row(5, extra_info={"split": "train"})
    path = write_jsonl(tmp_path / "mine.jsonl", [good_row(0), no_index])
    (a, b), _ = load_records([path])
    assert a.prompt_id == "0" and b.prompt_id == "mine:2"
    assert a.messages[1] == {"role": "user", "content": "What is 0 + 1?"}
    assert (a.data_source, a.ground_truth, a.ability) == ("unit/test", "1", "math")
    assert (a.source_file, a.source_line) == (str(path), 1)
    chat = a.chat()
    chat[0]["content"] = "changed"
    assert a.messages[0]["content"] == "Be brief."  # chat() returns copies


def test_ground_truth_optional_when_not_required(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [good_row(0, reward_model=None)])
    records, stats = load_records(path, require_ground_truth=False)
    assert records[0].ground_truth is None and stats.malformed == 0


def test_duplicate_prompt_ids_are_counted(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [good_row(0), good_row(1)])
    b = write_jsonl(tmp_path / "b.jsonl", [good_row(1)])
    records, stats = load_records([a, b])
    assert len(records) == 3 and stats.duplicate_ids == 1


def test_parquet_matches_jsonl_and_reports_row_numbers(tmp_path: Path) -> None:
    rows = [good_row(i) for i in range(5)]
    jpath = write_jsonl(tmp_path / "d.jsonl", rows)
    bad = dict(good_row(2), prompt=[{"role": "robot", "content": "x"}])
    ppath = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows[:2] + [bad] + rows[2:]), ppath, row_group_size=2)
    errors: list[RowError] = []
    from_parquet, stats = load_records([ppath], on_error=errors.append, batch_size=2)
    from_jsonl, _ = load_records([jpath])
    assert [(e.file, e.line, e.unit, e.kind) for e in errors] == [(str(ppath), 2, "row", "bad_role")]
    assert [(r.prompt_id, r.messages, r.ground_truth, r.data_source) for r in from_parquet] == [
        (r.prompt_id, r.messages, r.ground_truth, r.data_source) for r in from_jsonl
    ]
    assert [r.source_line for r in from_parquet] == [0, 1, 3, 4, 5]
    assert stats.records == 5


def test_mixed_files_are_read_in_order(tmp_path: Path) -> None:
    ppath = tmp_path / "first.parquet"
    pq.write_table(pa.Table.from_pylist([good_row(10), good_row(11)]), ppath)
    jpath = write_jsonl(tmp_path / "second.jsonl", [good_row(20)])
    assert [r.prompt_id for r in iter_records([ppath, jpath])] == ["10", "11", "20"]


@pytest.mark.parametrize("name", ["missing.jsonl", "data.csv", "data.json", "noext"])
def test_bad_paths_fail_at_startup(tmp_path: Path, name: str) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [good_row(0)])
    if name != "missing.jsonl":
        (tmp_path / name).write_text("{}\n")
    with pytest.raises(DataFileError, match=name):
        iter_records([good, tmp_path / name])  # eager: raised before any iteration
    with pytest.raises(DataFileError):
        PromptStream.from_files([good, tmp_path / name])


def test_corrupt_parquet_is_a_file_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataFileError, match="broken.parquet"):
        load_records([path])


def test_all_rows_malformed_is_an_error_for_the_stream(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", ["nope", "[]"])
    with pytest.raises(ValueError, match="no records"):
        PromptStream.from_files([path], on_error=lambda e: None)


def test_validation_set_is_ordered_single_pass(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "val.jsonl", [good_row(i) for i in range(6)] + ["{bad"])
    errors: list[RowError] = []
    val = read_validation_set([path], on_error=errors.append)
    assert [r.prompt_id for r in val] == [str(i) for i in range(6)]
    assert len(errors) == 1
    assert [r.prompt_id for r in read_validation_set(path, max_samples=2)] == ["0", "1"]
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataFileError, match="no valid records"):
        read_validation_set([empty])


def test_default_reporter_logs_capped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_jsonl(tmp_path / "many.jsonl", ["{bad"] * 30 + [good_row(0)])
    with caplog.at_level("WARNING", logger="rollout_service.data.reader"):
        records, stats = load_records(path)
    assert len(records) == 1 and stats.malformed == 30
    messages = [r.getMessage() for r in caplog.records]
    assert sum("skipping malformed row" in m for m in messages) == 20
    assert any("many.jsonl:line 1:" in m for m in messages)
    assert any("further ones are counted" in m for m in messages)
