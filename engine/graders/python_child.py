"""The child process of a ``python`` grader: runs the user's ``grade(sample, item)`` away from the
service. Started by ``engine.graders.python`` as ``python -I python_child.py <memory bytes> <CPU
seconds>`` with an empty environment, in a fresh temporary directory; it imports nothing of the
engine.

Before it reads any user code it:

- caps its address space (``RLIMIT_AS``), CPU time (``RLIMIT_CPU``, the whole batch's), the size
  of a file it writes, its open files, core dumps, and new processes (``RLIMIT_NPROC`` 0, which
  a process of root is exempt from);
- makes ``socket.socket`` and ``socket.create_connection`` raise;
- moves the protocol to file descriptors of its own and points descriptor 1 at 2, so what user
  code prints goes to the parent's log of the child, not into the answers;
- takes away ``os.pidfd_open`` and ``signal.pidfd_send_signal`` (signals without an audit event);
- installs an audit hook (``sys.addaudithook``, which cannot be removed) that refuses sockets,
  new processes (``subprocess``, ``os.system``, ``os.exec*``, ``os.fork``, ``os.posix_spawn``),
  signals to other processes, ``ctypes``, raising its limits, links, and opening or listing a
  path outside its working directory; the Python standard library and the installed packages
  stay readable (imports read them), never writable, and an extension module may only load from
  there. It also refuses importing what would run code out of the hook's sight
  (``_posixsubprocess``, sub-interpreters, ``ctypes``, the C API test modules), building code
  objects by hand, and compiled code the import system did not read from an installed file. So
  numpy, which loads its libraries with ``ctypes``, cannot be imported.

Audit hooks and resource limits are no operating-system sandbox: they stop what a grader's code
does through Python's own functions, not an exploit of an interpreter bug.

Protocol, one JSON object per line: the parent sends ``{"op": "load", "source", "timeout"}``,
answered ``{"ok": true}`` or ``{"ok": false, "error"}``; then ``{"op": "grade", "id", "sample",
"item"}`` per sample, answered ``{"id", "score"}`` or ``{"id", "error", "kind"}`` (kind
``runtime`` or ``timeout``). Each call runs under a wall-clock alarm of ``timeout`` seconds; the
parent also kills the child if an answer is late, so user code that ignores the alarm is stopped.
"""

from __future__ import annotations

import contextlib
import decimal
import importlib.util
import inspect
import json
import math
import numbers
import os
import resource
import signal
import site
import socket
import stat
import sys
import sysconfig
import tempfile
import traceback
import types
from collections.abc import Callable
from importlib.machinery import EXTENSION_SUFFIXES, SourceFileLoader, SourcelessFileLoader
from types import FrameType
from typing import Any, BinaryIO

FILENAME = "<grader>"
MODULE = "__grader__"
MAX_FILES = 64
MAX_FILE_BYTES = 64 << 20
REFUSED = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "os.symlink",
    "os.link",
    "os.startfile",
    "signal.pthread_kill",
    "ctypes.",
    "pty.",
    "resource.setrlimit",
    "resource.prlimit",
    "sqlite3.",
    "gc.get_",
    "code.__new__",  # a code object built by hand (types.CodeType, code.replace): unchecked bytecode
    "webbrowser.",
)
# modules a grader may not import: processes without the audit events (fork_exec), interpreters
# without this hook, raw memory
DENIED_MODULES = frozenset(
    {
        "_posixsubprocess",
        "_xxsubinterpreters",
        "_xxinterpchannels",
        "_interpreters",
        "_interpchannels",
        "_interpqueues",
        "_ctypes",
        "ctypes",
        "_cffi_backend",
        "cffi",
        "_testcapi",
        "_testinternalcapi",
        "_testbuffer",
        "_testmultiphase",
        "_testsinglephase",
        "_testimportmultiple",
        "_testclinic",
        "_xxtestfuzz",
        "_multiprocessing",
        "_posixshmem",
    }
)
# events whose first argument is a path that must lie in the working directory
WRITE_PATH_EVENTS = frozenset(
    {
        "os.chmod",
        "os.chown",
        "os.mkdir",
        "os.remove",
        "os.rmdir",
        "os.truncate",
        "os.utime",
        "os.setxattr",
        "os.removexattr",
        "shutil.chown",
        "shutil.copyfile",
        "shutil.copymode",
        "shutil.copystat",
        "shutil.copytree",
        "shutil.move",
        "shutil.rmtree",
        "shutil.make_archive",
        "shutil.unpack_archive",
    }
)
READ_PATH_EVENTS = frozenset({"os.listdir", "os.scandir", "os.listxattr", "os.getxattr"})
BOOTSTRAP = "<frozen importlib._bootstrap_external>"
STOCK_LOADERS = (SourceFileLoader, SourcelessFileLoader)
STOCK_GET_DATA = SourceFileLoader.get_data  # as it is before user code could replace it
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


class GraderTimeout(BaseException):
    """The call ran past its time (raised by the alarm; a BaseException, so that ``except
    Exception`` in user code does not swallow it)."""


def limit(memory: int, cpu_seconds: int) -> None:
    """Cap this process: address space, CPU seconds, file size, open files, no core dump, and no
    new process or thread (``RLIMIT_NPROC`` 0; a process of root is exempt from it)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_FILES, MAX_FILES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(ValueError, OSError):  # no new process or thread (root is exempt)
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))


def no_network() -> None:
    """``socket.socket`` and ``socket.create_connection`` raise (the audit hook refuses the rest)."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError("a grader has no network")

    socket.socket = refused  # type: ignore[assignment, misc]
    socket.create_connection = refused
    socket.socketpair = refused


def readable_roots() -> tuple[str, ...]:
    """The standard library's and the installed packages' folders (resolved)."""
    paths = sysconfig.get_paths()
    found = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    found += getattr(site, "getsitepackages", list)()
    return tuple(sorted({os.path.realpath(p) for p in found if p}))


def importing(frame: FrameType | None) -> bool:
    """Whether ``marshal.loads`` is called by the import system reading a file the standard way:
    ``_compile_bytecode`` called by ``get_code`` of a stock file loader, whose ``get_data`` is
    its own (so the bytes are a file's that the open check let through)."""
    caller = frame.f_back if frame is not None else None
    if frame is None or caller is None:
        return False
    if (frame.f_code.co_filename, frame.f_code.co_name) != (BOOTSTRAP, "_compile_bytecode"):
        return False
    if (caller.f_code.co_filename, caller.f_code.co_name) != (BOOTSTRAP, "get_code"):
        return False
    loader: Any = caller.f_locals.get("self")
    return (
        type(loader) in STOCK_LOADERS
        and "get_data" not in vars(loader)
        and type(loader).get_data is STOCK_GET_DATA
    )


def no_pidfd() -> None:
    """Take away ``os.pidfd_open`` and ``signal.pidfd_send_signal``: a signal sent through them
    raises no audit event."""
    for module in (os, sys.modules.get("posix")):
        if module is not None and hasattr(module, "pidfd_open"):
            delattr(module, "pidfd_open")
    for module in (signal, sys.modules.get("_signal")):
        if module is not None and hasattr(module, "pidfd_send_signal"):
            delattr(module, "pidfd_send_signal")


def audit_hook(workdir: str, readable: tuple[str, ...]) -> Callable[[str, tuple[Any, ...]], None]:
    """The audit hook of the child: what a grader may not do raises ``PermissionError``. A
    module loaded before it may not be imported again (a fresh ``posix`` would bring back what
    ``no_pidfd`` took away)."""
    loaded = frozenset(sys.modules)

    def inside(path: Any, roots: tuple[str, ...]) -> bool:
        real = os.path.realpath(os.fsdecode(path))
        return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)

    def device(path: Any) -> bool:
        try:
            mode = os.stat(os.fsdecode(path)).st_mode
        except (OSError, ValueError):
            return False
        return stat.S_ISBLK(mode) or stat.S_ISCHR(mode)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith(REFUSED):
            raise PermissionError(f"a grader may not do this ({event})")
        if event == "open":
            path, flags = args[0], args[2] if len(args) > 2 else None
            if isinstance(path, int) or path is None:
                return
            if inside(path, (workdir,)):
                if os.fsdecode(path).endswith((".pyc", ".pyo")):  # compiled code: only the installed
                    raise PermissionError(f"a grader may not open compiled code ({path!r})")
                if device(path):  # a node root made there (os.mknod raises no audit event)
                    raise PermissionError(f"a grader may not open a device ({path!r})")
                return
            writes = not isinstance(flags, int) or flags & WRITE_FLAGS
            if not writes and inside(path, readable):
                return
            raise PermissionError(f"a grader may only open files in its working directory, not {path!r}")
        if event in WRITE_PATH_EVENTS or event == "os.rename":
            paths = args[:2] if event == "os.rename" else args[:1]
            for path in paths:
                if isinstance(path, str | bytes | os.PathLike) and not inside(path, (workdir,)):
                    message = f"a grader may only change files in its working directory ({event})"
                    raise PermissionError(message)
        elif event in READ_PATH_EVENTS:
            path = args[0] if args else "."
            if isinstance(path, str | bytes | os.PathLike) and not inside(path, (workdir, *readable)):
                raise PermissionError(f"a grader may only list its working directory ({event})")
        elif event == "import":
            name = str(args[0]) if args else ""
            if name in DENIED_MODULES or name.partition(".")[0] in DENIED_MODULES:
                # an ImportError, as for a module that is not there: numpy imports without ctypes
                raise ImportError(f"a grader may not import {name}", name=name)
            if name in loaded:
                raise PermissionError(f"a grader may not import {name} again")
            filename = os.fsdecode(args[1]) if len(args) > 1 and args[1] else ""
            if filename.endswith(tuple(EXTENSION_SUFFIXES)) and not inside(filename, readable):
                raise PermissionError(f"a grader may not load the extension module {filename!r}")
        elif event == "marshal.loads" and not importing(sys._getframe(1)):
            raise PermissionError("a grader may not load compiled code (marshal.loads)")

    return hook


def error_line(exc: BaseException) -> str:
    """``"ZeroDivisionError: division by zero (line 3)"``: the exception and the grader's line."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == FILENAME:
            line = frame.lineno
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if isinstance(exc, MemoryError):
        text = "MemoryError: the grader ran out of its memory limit"
    return f"{text} (line {line})" if line is not None else text


def on_alarm(signum: int, frame: Any) -> None:
    raise GraderTimeout


def call(function: Callable[..., Any], timeout: float, *args: Any) -> Any:
    """``function(*args)`` under an alarm of ``timeout`` seconds."""
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return function(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def load(source: str, timeout: float) -> tuple[Callable[..., Any] | None, str | None]:
    """Compile and run the grader's source; its ``grade`` function, or why there is none."""
    module = types.ModuleType(MODULE)  # a module of its own (dataclasses look their module up)
    sys.modules[MODULE] = module
    namespace = module.__dict__
    try:
        code = compile(source, FILENAME, "exec")
        call(exec, timeout, code, namespace)
    except GraderTimeout:
        return None, f"running the source took longer than {timeout:g} s"
    except SyntaxError as exc:
        return None, f"SyntaxError: {exc.msg} (line {exc.lineno})"
    except BaseException as exc:
        return None, error_line(exc)
    grade = namespace.get("grade")
    if not callable(grade):
        return None, "the source defines no function grade(sample, item)"
    try:
        inspect.signature(grade).bind(None, None)
    except TypeError:
        return None, "grade must take two arguments: grade(sample, item)"
    except ValueError:  # no signature to inspect (a builtin): let the call tell
        pass
    return grade, None


def as_score(value: Any) -> tuple[float | None, str | None]:
    """A returned value as a finite float, or why it is not one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real | decimal.Decimal):
        return None, f"grade returned {type(value).__name__}, not a number"
    try:
        score = float(value)
    except (TypeError, ValueError, OverflowError) as exc:
        return None, f"grade returned {value!r}, not a number: {exc}"
    if not math.isfinite(score):
        return None, f"grade returned {score}, not a finite number"
    return score, None


def serve(inbox: BinaryIO, outbox: BinaryIO, confined: list[str]) -> None:
    """Answer the parent's requests until it closes the pipe. Each answer carries its request's
    ``id``, a token the parent draws afresh for each request: a line that user code writes to the
    answer pipe without it is no answer but a broken protocol (the parent kills the child)."""
    grade: Callable[..., Any] | None = None
    timeout = 1.0

    def answer(message: dict[str, Any]) -> None:
        outbox.write(json.dumps(message).encode() + b"\n")
        outbox.flush()

    for line in inbox:
        request = json.loads(line)
        ident = request["id"]
        if request["op"] == "load":
            timeout = float(request["timeout"])
            grade, error = load(request["source"], timeout)
            loaded = {"ok": True} if error is None else {"ok": False, "error": error}
            answer({"id": ident, "confined": confined} | loaded)
            continue
        if grade is None:
            answer({"id": ident, "error": "no grader is loaded", "kind": "runtime"})
            continue
        try:
            try:
                value = call(grade, timeout, request["sample"], request["item"])
            except GraderTimeout:
                answer({"id": ident, "error": f"timed out after {timeout:g} s", "kind": "timeout"})
                continue
            except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the sample failed
                answer({"id": ident, "error": error_line(exc), "kind": "runtime"})
                continue
            score, problem = as_score(value)
            if score is None:
                answer({"id": ident, "error": problem, "kind": "runtime"})
            else:
                answer({"id": ident, "score": score})
        except GraderTimeout:  # the alarm fired just as the call returned
            answer({"id": ident, "error": f"timed out after {timeout:g} s", "kind": "timeout"})


def confine_self(layers: list[str], workdir: str, readable: tuple[str, ...]) -> list[str]:
    """Apply the kernel's layers this box gives (``engine.graders.confine``, loaded by path: the
    child imports nothing of the engine) and forget the modules they needed (``ctypes``); the
    layers applied."""
    if not layers:
        return []
    before = set(sys.modules)
    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), "confine.py")
    spec = importlib.util.spec_from_file_location("_grader_confine", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    applied = []
    module.no_new_privileges()
    module.drop_capabilities()
    if "landlock" in layers:
        module.restrict_filesystem(module.landlock_abi(), (*readable, *module.SYSTEM_LIBRARIES), (workdir,))
        applied.append("landlock")
    if "seccomp" in layers:
        module.filter_system_calls(os.getpid())
        applied.append("seccomp")
    del module, spec
    for name in set(sys.modules) - before:  # ctypes and what it brought: imported again, each meets
        del sys.modules[name]  # the audit hook
    return applied


def main() -> None:
    memory, cpu_seconds = int(sys.argv[1]), int(sys.argv[2])
    layers = [] if sys.argv[3] == "-" else sys.argv[3].split(",")
    audit = len(sys.argv) < 5 or sys.argv[4] != "no-audit-hook"
    workdir = os.path.realpath(os.getcwd())
    readable = readable_roots()
    limit(memory, cpu_seconds)
    no_network()
    tempfile.tempdir = workdir
    inbox, outbox = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    try:
        applied = confine_self(layers, workdir, readable)
    except OSError as exc:
        print(f"the grader's confinement failed: {exc}", file=sys.stderr)
        sys.exit(70)
    signal.signal(signal.SIGALRM, on_alarm)
    no_pidfd()
    if audit:
        sys.addaudithook(audit_hook(workdir, readable))
    serve(inbox, outbox, applied)


if __name__ == "__main__":
    main()
