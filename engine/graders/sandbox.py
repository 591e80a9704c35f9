"""Which operating-system confinement this box gives a ``python`` grader's child, and the command
that starts the child under it.

Three kernel layers, each used where the box offers it, under the child's own Python layer (audit
hooks and resource limits, ``engine.graders.python_child``):

- **namespaces**, by bubblewrap (``bwrap``, Debian's ``bubblewrap``): the child gets its own user
  (no capability on the host), mount, PID, network, IPC, UTS and cgroup namespaces. Its filesystem
  is its working directory (read-write), the Python installation and the system libraries
  (read-only), a private ``/proc`` of its own PID namespace and a minimal ``/dev``; its network is
  a loopback of its own with nothing on it. Needs user namespaces: a root service, or an
  unprivileged one where the kernel allows them (Docker's default seccomp profile does not).
- **Landlock** (kernels 5.13+; the child applies it to itself): the same filesystem view by access
  rights, no TCP (ABI 4+), no signal to and no abstract socket of a process outside (ABI 6+).
- **seccomp** (libseccomp, ``libseccomp2``; the child loads the filter itself): no new process
  beyond its own threads, no ``exec``, no socket (``socketpair`` only), no ``ptrace``, ``mount``,
  namespaces, keyrings, ``bpf``, ``userfaultfd``, ``memfd_create`` or ``io_uring``; signals and
  scheduling changes only to itself. With it: no new privileges, every capability dropped.

The child is confined when it has seccomp and a filesystem layer (namespaces or Landlock). On a box
that gives less, python graders are refused unless the operator sets ``UNCONFINED_SETTING`` to
accept the Python layer alone (off by default). ``describe()`` says what this box gives; the
service logs it at start.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import engine.graders.confine as confine

CHILD = Path(__file__).with_name("python_child.py")
UNCONFINED_SETTING = "ROUNDHOUSE_ALLOW_UNCONFINED_GRADERS"
NOBODY = 65534
PROBE_TIMEOUT_S = 20.0
# what the child's environment holds: no thread pools (the child may start no thread on most boxes)
CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LC_ALL": "C.UTF-8"}


@dataclass(frozen=True)
class Confinement:
    """The kernel layers a grader's child runs under on this box."""

    bwrap: str | None  # bubblewrap's path, when it makes the namespaces here
    landlock: int  # the Landlock ABI version; 0 without
    seccomp: bool

    @property
    def confined(self) -> bool:
        return self.seccomp and (self.bwrap is not None or self.landlock > 0)

    def layers(self) -> list[str]:
        """What the child applies to itself (the namespaces are bubblewrap's): the words it is sent."""
        return [name for name, on in (("landlock", self.landlock > 0), ("seccomp", self.seccomp)) if on]

    def describe(self) -> str:
        parts = []
        if self.bwrap:
            parts.append("bubblewrap namespaces (user, mount, PID, network, IPC)")
        if self.landlock:
            parts.append(f"Landlock ABI {self.landlock}")
        if self.seccomp:
            parts.append("a seccomp filter with no new privileges")
        kernel = ", ".join(parts) if parts else "no kernel confinement"
        if self.confined:
            verdict = "confined"
        elif unconfined_allowed():
            verdict = f"NOT confined by the kernel: allowed by {UNCONFINED_SETTING}"
        else:
            verdict = f"refused (set {UNCONFINED_SETTING}=true to accept Python audit hooks alone)"
        return f"python graders: {kernel}; audit hooks and resource limits; {verdict}"


def unconfined_allowed() -> bool:
    return os.environ.get(UNCONFINED_SETTING, "").strip().lower() in ("1", "true", "yes", "on")


def refusal(confinement: Confinement) -> str | None:
    """Why python graders are refused on this box, or None."""
    if confinement.confined or unconfined_allowed():
        return None
    missing = [] if confinement.seccomp else ["seccomp (libseccomp2)"]
    if confinement.bwrap is None and not confinement.landlock:
        missing.append("a filesystem confinement (bubblewrap with user namespaces, or Landlock)")
    return (
        "python graders are refused: this box gives their process no kernel confinement "
        f"(missing: {', '.join(missing)}); an operator may accept Python audit hooks alone by "
        f"setting {UNCONFINED_SETTING}=true"
    )


def readable_roots() -> list[str]:
    """What the child may read: the Python installation (the interpreter's prefixes, the standard
    library, the installed packages) and the system's shared libraries (resolved, existing)."""
    paths = sysconfig.get_paths()
    found = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    found += [paths.get(k) or "" for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    found += [os.path.dirname(os.path.realpath(sys.executable))]
    found += list(confine.SYSTEM_LIBRARIES)
    roots = sorted({os.path.realpath(p) for p in found if p and os.path.exists(p)})
    return [r for r in roots if not any(r != o and r.startswith(o.rstrip("/") + "/") for o in roots)]


def command(confinement: Confinement, workdir: str, arguments: list[str], *, audit: bool = True) -> list[str]:
    """The child's command line: ``python -I python_child.py <arguments> <layers>``, inside
    bubblewrap's namespaces where this box has them (``audit`` False: without the audit hook, for
    the tests that show the kernel's layers hold alone)."""
    layers = ",".join(confinement.layers()) or "-"
    child = [sys.executable, "-I", str(CHILD), *arguments, layers, *([] if audit else ["no-audit-hook"])]
    if confinement.bwrap is None:
        return child
    return [*bwrap_prefix(confinement.bwrap, workdir), *child]


def bwrap_prefix(bwrap: str, workdir: str) -> list[str]:
    binds: list[str] = []
    for path in confine.SYSTEM_LIBRARIES:  # /lib, /lib64: links into /usr/lib on a merged /usr
        if os.path.islink(path):
            binds += ["--symlink", os.readlink(path), path]
    for root in [*readable_roots(), str(CHILD.parent.resolve())]:
        binds += ["--ro-bind", root, root]
    executable = os.path.dirname(sys.executable)  # a virtualenv's bin/ (its python is a link)
    if not os.path.realpath(executable).startswith(tuple(r + "/" for r in readable_roots())):
        binds += ["--ro-bind", executable, executable]
    return [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--uid", str(NOBODY),
        "--gid", str(NOBODY),
        "--hostname", "grader",
        "--die-with-parent",
        "--cap-drop", "ALL",
        *binds,
        "--bind", workdir, workdir,
        "--proc", "/proc",
        "--dev", "/dev",
        "--chdir", workdir,
        "--",
    ]  # fmt: skip


def _bwrap_works(bwrap: str) -> bool:
    """Whether bubblewrap makes the child's namespaces here: it runs the interpreter once."""
    workdir = tempfile.mkdtemp(prefix="roundhouse-grader-probe-")
    try:
        probe = [*bwrap_prefix(bwrap, workdir), sys.executable, "-I", "-c", "import json"]
        done = subprocess.run(
            probe,
            env=CHILD_ENV,
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        return done.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@functools.cache
def detect() -> Confinement:
    """What this box gives (probed once a process)."""
    bwrap = shutil.which("bwrap")
    return Confinement(
        bwrap=bwrap if bwrap and _bwrap_works(bwrap) else None,
        landlock=confine.landlock_abi() if sys.platform == "linux" else 0,
        seccomp=sys.platform == "linux" and confine.seccomp_available(),
    )
