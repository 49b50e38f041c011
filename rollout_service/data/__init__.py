"""Prompt datasets for the rollout service: verl-layout JSONL/Parquet readers that report
and skip malformed rows, a resumable shuffled prompt stream, and the built-in demo task.
See docs/data_and_rewards.md."""

from .demo_task import DATA_SOURCE as DEMO_DATA_SOURCE
from .demo_task import ArithSpec, generate_rows, write_demo_dataset
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
    "DEMO_DATA_SOURCE",
    "ERROR_KINDS",
    "ArithSpec",
    "DataFileError",
    "PromptRecord",
    "PromptStream",
    "ReadStats",
    "RowError",
    "RowValidationError",
    "check_files",
    "dataset_fingerprint",
    "generate_rows",
    "iter_records",
    "load_records",
    "logging_reporter",
    "read_validation_set",
    "record_from_row",
    "write_demo_dataset",
]
