"""Datasets: read and validate files, render with chat templates, mask, pack and batch."""

from engine.data.read import (
    FORMATS,
    Checked,
    Example,
    RowError,
    check_rows,
    detect_format,
    read_examples,
    read_records,
)

__all__ = [
    "FORMATS",
    "Checked",
    "Example",
    "RowError",
    "check_rows",
    "detect_format",
    "read_examples",
    "read_records",
]
