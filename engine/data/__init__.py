"""Datasets: read and validate files, render with chat templates, mask, pack and batch.

The row formats are one registry (``engine.data.formats``); ``format_names()`` lists them."""

from engine.data.formats import detect_format, format_names, get_format
from engine.data.read import Checked, Example, RowError, check_rows, read_examples, read_records

__all__ = [
    "Checked",
    "Example",
    "RowError",
    "check_rows",
    "detect_format",
    "format_names",
    "get_format",
    "read_examples",
    "read_records",
]
