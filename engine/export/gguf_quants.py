"""The GGUF quantizations the exporter writes (``engine.export.gguf_model``): the one list. The
GGUF export format's variants (``engine.export.formats``), and through it the CLI's choices, the
API's values and the web UI's list, are this tuple."""

from __future__ import annotations

QUANTS = ("f16", "bf16", "q8_0", "q4_k_m")
