"""Prompt datasets for the rollout service: verl-layout JSONL/Parquet readers that report
and skip malformed rows and a resumable shuffled prompt stream
(the built-in demo task is :mod:`recipes.demo.task`, whose files the launcher writes).
See docs/data_and_rewards.md."""

from .reader import (
    DataFileError,
    ReadStats,
    check_files,
    iter_records,
    load_records,
    logging_reporter,
    read_validation_set,
)
from .records import (
    ALLOWED_ROLES,
    ERROR_KINDS,
    PromptRecord,
    RowError,
    RowValidationError,
    record_from_row,
)
from .stream import PromptStream, dataset_fingerprint

__all__ = [
    "ALLOWED_ROLES",
    "ERROR_KINDS",
    "DataFileError",
    "PromptRecord",
    "PromptStream",
    "ReadStats",
    "RowError",
    "RowValidationError",
    "check_files",
    "dataset_fingerprint",
    "iter_records",
    "load_records",
    "logging_reporter",
    "read_validation_set",
    "record_from_row",
]
