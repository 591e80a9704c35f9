"""Datasets: read and validate files, render with chat templates, mask, pack and batch."""

from engine.data.read import FORMATS, Example, RowError, detect_format, read_examples, read_records

__all__ = ["FORMATS", "Example", "RowError", "detect_format", "read_examples", "read_records"]
