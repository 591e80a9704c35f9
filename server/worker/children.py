"""What every child process of the worker shares: it dies with the process that started it.

The worker starts three kinds of children, each a fresh interpreter: a job's training run
(``supervisor``), an evaluation (``evaluator``) and the inference service (``inference_link``).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec (``preexec_fn``): the kernel kills it when its parent dies (Linux)."""
    # not Linux: no prctl, and the child's own parent watch still stops it
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
