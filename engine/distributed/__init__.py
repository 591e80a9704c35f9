"""One job across several boxes: each box runs its own RoundPipe pipeline on its share of every
batch, and the boxes sum their gradients before each optimizer step over torch.distributed
(gloo: the gradients are host tensors). ``Boxes`` says where a process stands in such a job,
``BoxLost`` is what a box raises when another one is gone, and ``group`` holds the collectives
(``Group``: a rendezvous store with heartbeats, the gradient exchange, the control messages).
The names below are this package's public face, each loaded on first use (``Boxes`` needs no
torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.distributed.boxes import RENDEZVOUS_PORT, Boxes, BoxLost
    from engine.distributed.consent import required_rows
    from engine.distributed.group import Group, join

# name -> the module that defines it (imported on first use)
_HOMES = {
    "RENDEZVOUS_PORT": "engine.distributed.boxes",
    "BoxLost": "engine.distributed.boxes",
    "Boxes": "engine.distributed.boxes",
    "Group": "engine.distributed.group",
    "join": "engine.distributed.group",
    "required_rows": "engine.distributed.consent",
}
__all__ = ["RENDEZVOUS_PORT", "BoxLost", "Boxes", "Group", "join", "required_rows"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
