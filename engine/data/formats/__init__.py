"""Data formats: the registry (``engine.data.formats.base``) and every format, one module each.

Each module below defines its format and registers it when imported; the order of these imports
is the order of listings and error messages. Adding a format is one module that calls
``register`` and one import here. ``format_names()`` is the one list of format names: the run
configuration's ``data.format``, the service's upload validation, its schema and the datasets page
all read it.
"""

# isort: off
# each module registers its format as it is imported: this order is the registry's
from engine.data.formats import chat
from engine.data.formats import sharegpt
from engine.data.formats import instruction
from engine.data.formats import prompt_completion
from engine.data.formats import text
from engine.data.formats import preference
from engine.data.formats import prompts
from engine.data.formats import kto

# isort: on
from engine.data.formats.base import (
    FAMILIES,
    DataFormat,
    Family,
    FormatChoice,
    choose_format,
    detect_format,
    family_of,
    format_names,
    formats_listing,
    formats_of,
    get_format,
    register,
    titles,
)

MODULES = (chat, sharegpt, instruction, prompt_completion, text, preference, prompts, kto)

__all__ = [
    "FAMILIES",
    "MODULES",
    "DataFormat",
    "Family",
    "FormatChoice",
    "choose_format",
    "detect_format",
    "family_of",
    "format_names",
    "formats_listing",
    "formats_of",
    "get_format",
    "register",
    "titles",
]
