"""What each worker keeps of the model between stages: the layers' structure, no weights.

A worker copies every layer onto the meta device once and runs a stage by calling the copy with
that stage's uploaded tensors (``torch.func.functional_call``). Workers on one device share its
random generator, so the dropout seeding runs under the device's lock.
"""

from __future__ import annotations

import copy
import itertools
import threading
from typing import Any

import torch

# A device's generator is shared by every worker thread on that device (all CPU workers, or
# two workers listed on one GPU): seeding and drawing must not interleave between threads, so a
# layer that uses dropout runs under its device's lock.
_RNG_LOCKS: dict[str, threading.Lock] = {}
_RNG_LOCKS_GUARD = threading.Lock()


def rng_lock(device: torch.device) -> threading.Lock:
    """The lock of ``device``'s random generator."""
    with _RNG_LOCKS_GUARD:
        return _RNG_LOCKS.setdefault(str(device), threading.Lock())


def meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A structural copy of ``module`` whose tensors take no memory (filled per stage)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        stand_in = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            torch.nn.Parameter(stand_in, t.requires_grad) if isinstance(t, torch.nn.Parameter) else stand_in
        )
    return copy.deepcopy(module, memo)
