"""Datasets: read and validate files, render with chat templates, mask, pack and batch.

The row formats are one registry (``engine.data.formats``); ``format_names()`` lists them,
``formats_listing()`` describes them. ``read_records`` reads a file's rows (``SUFFIXES``: the
file types), ``validate`` checks every row by its format and reports token lengths (``Report``),
``encode_example`` and its kin turn rows into token sequences. A dataset may be an archive of one
data file and its images (``ARCHIVE_SUFFIXES``, ``unpack``); a row's images are references
(``image_ref``: data URLs, file names, ``sha256:``) read as its row is checked. The names below
are this package's public face, each loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.data.archives import ARCHIVE_SUFFIXES, archive_suffix, unpack
    from engine.data.encode import (
        Report,
        encode_pair,
        encode_prompt_row,
        ensure_chat_template,
        validate,
    )
    from engine.data.encode import encode as encode_example
    from engine.data.formats import (
        DataFormat,
        Family,
        FormatChoice,
        detect_format,
        family_of,
        format_names,
        formats_listing,
        get_format,
    )
    from engine.data.images import ImageRef, decode_data_url, image_ref
    from engine.data.read import SUFFIXES, Checked, Example, RowError, check_rows, read_examples, read_records

# name -> the module that defines it (imported on first use)
_HOMES = {
    "ARCHIVE_SUFFIXES": "engine.data.archives",
    "ImageRef": "engine.data.images",
    "archive_suffix": "engine.data.archives",
    "decode_data_url": "engine.data.images",
    "image_ref": "engine.data.images",
    "unpack": "engine.data.archives",
    "SUFFIXES": "engine.data.read",
    "Checked": "engine.data.read",
    "DataFormat": "engine.data.formats",
    "Example": "engine.data.read",
    "Family": "engine.data.formats",
    "FormatChoice": "engine.data.formats",
    "Report": "engine.data.encode",
    "RowError": "engine.data.read",
    "check_rows": "engine.data.read",
    "detect_format": "engine.data.formats",
    "encode_example": "engine.data.encode",
    "encode_pair": "engine.data.encode",
    "encode_prompt_row": "engine.data.encode",
    "ensure_chat_template": "engine.data.encode",
    "family_of": "engine.data.formats",
    "format_names": "engine.data.formats",
    "formats_listing": "engine.data.formats",
    "get_format": "engine.data.formats",
    "read_examples": "engine.data.read",
    "read_records": "engine.data.read",
    "validate": "engine.data.encode",
}
# names the face gives under another name: a submodule called ``encode`` would shadow ``encode``
_RENAMED = {"encode_example": "encode"}
__all__ = [
    "ARCHIVE_SUFFIXES",
    "SUFFIXES",
    "Checked",
    "DataFormat",
    "Example",
    "Family",
    "FormatChoice",
    "ImageRef",
    "Report",
    "RowError",
    "archive_suffix",
    "check_rows",
    "decode_data_url",
    "detect_format",
    "encode_example",
    "encode_pair",
    "encode_prompt_row",
    "ensure_chat_template",
    "family_of",
    "format_names",
    "formats_listing",
    "get_format",
    "image_ref",
    "read_examples",
    "read_records",
    "unpack",
    "validate",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), _RENAMED.get(name, name))
