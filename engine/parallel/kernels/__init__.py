"""The engine's own host kernels, in C, built on first use with the machine's C compiler.

``adamw.c``: one pass of AdamW over a flat fp32 block that also writes the compute copy the
workers upload (``engine.parallel.units``). ``fold.c``: a gradient contribution into its fp32
buffer, returning the buffer's squared norm (``engine.parallel.gradients``), so the global norm
needs no pass of its own. A shared library is built once per source and
compiler flags into ``$ROUNDHOUSE_KERNEL_CACHE`` (default ``~/.cache/roundhouse/kernels``), with
OpenMP for the threads; it is called through ctypes, which releases the GIL for the call.

Without a C compiler, or with ``ROUNDHOUSE_KERNELS=0``, ``adamw()`` and ``fold()`` are None and
the engine uses torch: its fused AdamW and a separate copy, an add and a norm per unit (the same
arithmetic, more passes); tests hold the two paths to each other.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# -fno-math-errno lets sqrtf vectorize; -march=native: the library is built on (and for) the
# machine that runs it, and its cache key includes this CPU's feature flags
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-march=native", "-fopenmp", "-shared", "-fPIC"]
OUT_KINDS = {"none": 0, "float32": 1, "bfloat16": 2, "float16": 3}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "roundhouse" / "kernels"
    return Path(os.environ.get("ROUNDHOUSE_KERNEL_CACHE", default))


def _cpu_flags() -> str:
    """This CPU's feature flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine()


def _build(source: Path) -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: the optimizer uses torch's fused AdamW and a separate copy")
        return None
    key = source.read_bytes() + " ".join([compiler, *FLAGS, _cpu_flags()]).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: processes building at once never load a torn file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(built), "-lm"], capture_output=True, text=True
        )
        if done.returncode != 0:
            log.warning("building %s failed; torch's fused AdamW is used:\n%s", source.name, done.stderr)
            return None
        os.replace(built, target)
    return target


def _load(name: str, symbol: str) -> Any:
    if os.environ.get("ROUNDHOUSE_KERNELS", "1") == "0":
        return None
    try:
        path = _build(HERE / f"{name}.c")
        if path is None:
            return None
        return getattr(ctypes.CDLL(str(path)), symbol)
    except OSError as exc:
        log.warning("the %s kernel could not be loaded (%s); torch is used", name, exc)
        return None


@functools.cache
def adamw() -> Any:
    """The one-pass AdamW kernel, or None (disabled, or it cannot be built here)."""
    fn = _load("adamw", "roundhouse_adamw")
    if fn is not None:
        f, p = ctypes.c_float, ctypes.c_void_p
        fn.argtypes = [p, p, p, p, p, ctypes.c_int, ctypes.c_int64, f, f, f, f, f, f, f, f, ctypes.c_int]
        fn.restype = None
    return fn


@functools.cache
def fold() -> Any:
    """The fold kernel (add or write a contribution, return the squared norm), or None."""
    fn = _load("fold", "roundhouse_fold")
    if fn is not None:
        p = ctypes.c_void_p
        fn.argtypes = [p, p, ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_double
    return fn
