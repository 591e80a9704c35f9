"""A python grader's child is confined by the kernel, not only by Python: attempts to get out, made
from inside a grader, each fail and are that sample's error while the samples around them are
still scored; the same attempts fail with the child's audit hook taken away (the kernel's layers
alone), and on a box with Landlock and seccomp but no namespaces. Seen from the outside, the
grader's process has no new privileges, a seccomp filter and a network namespace of its own; the
listeners it tried to reach heard nothing, the files it tried to make do not exist."""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from engine.errors import ConfigError
from engine.graders import sandbox, validate_grader
from engine.graders.python import PythonGrader
from engine.graders.sandbox import Confinement

BOX = sandbox.detect()
NO_NAMESPACES = Confinement(bwrap=None, landlock=BOX.landlock, seccomp=BOX.seccomp)  # a box without them
pytestmark = pytest.mark.skipif(not BOX.confined, reason=f"this box confines no grader: {BOX.describe()}")

# a C extension that makes raw system calls, as code that took over the interpreter would
EXTENSION = r"""
#define _GNU_SOURCE
#include <Python.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

static PyObject *attempt(PyObject *self, PyObject *args) {
    const char *what, *path;
    long pid;
    if (!PyArg_ParseTuple(args, "ssl", &what, &path, &pid)) return NULL;
    long r = -1;
    if (!strcmp(what, "open")) r = syscall(SYS_openat, AT_FDCWD, path, O_RDONLY);
    else if (!strcmp(what, "socket")) r = syscall(SYS_socket, AF_INET, SOCK_STREAM, 0);
    else if (!strcmp(what, "fork")) {
        r = syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
        if (r == 0) syscall(SYS_exit, 0);
    }
    else if (!strcmp(what, "exec")) {
        char *argv[] = {"/bin/sh", "-c", "true", NULL};
        char *envp[] = {NULL};
        r = syscall(SYS_execve, "/bin/sh", argv, envp);
    }
    else if (!strcmp(what, "kill")) r = syscall(SYS_kill, pid, 0);
    else if (!strcmp(what, "ptrace")) r = syscall(SYS_ptrace, PTRACE_ATTACH, pid, 0, 0);
    if (r < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(r);
}

static PyMethodDef methods[] = {{"attempt", attempt, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "escape", NULL, -1, methods};
PyMODINIT_FUNC PyInit_escape(void) { return PyModule_Create(&module); }
"""

# each attempt is the body of grade(sample, item): it returns 1.0 when it got through, so a
# refusal must surface as an exception (the sample's error)
LIBC = "import ctypes, ctypes.util\n    libc = ctypes.CDLL(None, use_errno=True)\n    "
CHECK = "\n    if r < 0:\n        raise OSError(ctypes.get_errno(), 'refused')\n    return 1.0"
ATTEMPTS = {
    "read the database": "return float(len(open(item['db'], 'rb').read()))",
    "read a dataset": "return float(len(open(item['dataset'], 'rb').read()))",
    "read the parent's environment": (
        "return float(len(open(f\"/proc/{item['parent']}/environ\", 'rb').read()))"
    ),
    "read /etc/shadow": "return float(len(open('/etc/shadow', 'rb').read()))",
    "stat outside": "import os\n    os.stat(item['db'])\n    return 1.0",
    "exists outside": (
        "import os\n    if not os.path.exists(item['db']):\n        raise FileNotFoundError(item['db'])\n"
        "    return 1.0"
    ),
    "readlink outside": "import os\n    return float(len(os.readlink(item['link'])))",
    "list the root": "import os\n    return float(len(os.listdir('/')))",
    "list /proc": "import os\n    return float(len([p for p in os.listdir('/proc') if p.isdigit()]))",
    "write outside": "open(item['outside'] + '/written', 'w').write('x')\n    return 1.0",
    "mkfifo outside": "import os\n    os.mkfifo(item['outside'] + '/fifo')\n    return 1.0",
    "mknod outside": (
        "import os, stat\n    os.mknod(item['outside'] + '/node', 0o600 | stat.S_IFREG)\n    return 1.0"
    ),
    "hard link outside": (
        "import os\n    os.link(item['db'], 'db')\n    return float(len(open('db', 'rb').read()))"
    ),
    "tcp": (
        "import _socket\n    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
        "    s.connect(('127.0.0.1', item['tcp']))\n    return 1.0"
    ),
    "udp": (
        "import _socket\n    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)\n"
        "    s.sendto(b'hello', ('127.0.0.1', item['udp']))\n    return 1.0"
    ),
    "unix socket": (
        "import _socket\n    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)\n"
        "    s.connect(item['unix'])\n    return 1.0"
    ),
    "fork": "import os\n    if os.fork() == 0:\n        os._exit(0)\n    return 1.0",
    "exec": "import os\n    os.execv('/bin/sh', ['sh', '-c', 'true'])",
    "system": (
        "import os\n    if os.system('true') != 0:\n        raise OSError('system() failed')\n    return 1.0"
    ),
    "posix_spawn": "import os\n    os.posix_spawn('/bin/true', ['true'], {})\n    return 1.0",
    "memfd exec": (
        "import os\n    fd = os.memfd_create('x')\n    os.write(fd, open('/bin/true', 'rb').read())\n"
        "    os.execv(f'/proc/self/fd/{fd}', ['x'])"
    ),
    "signal the parent": "import os, signal\n    os.kill(item['parent'], signal.SIGURG)\n    return 1.0",
    "signal the parent's group": (
        "import os, signal\n    os.killpg(os.getpgid(item['parent']), signal.SIGURG)\n    return 1.0"
    ),
    "renice the parent": "import os\n    os.setpriority(os.PRIO_PROCESS, item['parent'], 19)\n    return 1.0",
    "ptrace the parent": LIBC + "r = libc.ptrace(16, item['parent'], 0, 0)" + CHECK,
    "libc system": LIBC + "r = -1 if libc.system(b'true') != 0 else 0" + CHECK,
    "libc fork": LIBC + "r = libc.fork()\n    if r == 0:\n        libc._exit(0)" + CHECK,
    "libc socket": LIBC + "r = libc.socket(2, 1, 0)" + CHECK,
    "libc open": LIBC + "r = libc.open(item['db'].encode(), 0)" + CHECK,
    "libc mount": LIBC + "r = libc.mount(b'none', b'.', b'tmpfs', 0, None)" + CHECK,
    "add_key": LIBC + "r = libc.syscall(248, b'user', b'k', b'v', 1, -4)" + CHECK,
    "bpf": LIBC + "r = libc.syscall(321, 0, None, 0)" + CHECK,
    "userfaultfd": LIBC + "r = libc.syscall(323, 0)" + CHECK,
    "unshare a user namespace": LIBC + "r = libc.unshare(0x10000000)" + CHECK,
    "cffi": (
        "import _cffi_backend as b\n    lib = b.load_library(None)\n"
        "    f = lib.load_function(b.new_function_type((), b.new_primitive_type('int')), 'fork')\n"
        "    r = f()\n    if r < 0:\n        raise OSError('refused')\n    return 1.0"
    ),
    "forge an answer": (
        "import os\n    for fd in range(3, 64):\n        try:\n"
        '            os.write(fd, b\'{"id": 0, "score": 1.0}\\n\')\n'
        "        except OSError:\n            pass\n    return 0.5"
    ),
    "a crafted code object": (
        "code = grade.__code__.replace(co_code=bytes([0x64, 0xFF, 0x53, 0x00]))\n"
        "    return float(eval(code) or 1.0)"
    ),
    "crash the interpreter": "import faulthandler\n    faulthandler._sigsegv()\n    return 1.0",
    "a C extension's raw syscalls": (
        "import base64, importlib.machinery, importlib.util\n"
        "    open('escape.so', 'wb').write(base64.b64decode(item['extension']))\n"
        "    loader = importlib.machinery.ExtensionFileLoader('escape', 'escape.so')\n"
        "    spec = importlib.util.spec_from_file_location('escape', 'escape.so', loader=loader)\n"
        "    escape = importlib.util.module_from_spec(spec)\n"
        "    for what in ('open', 'socket', 'fork', 'kill', 'ptrace', 'exec'):\n"
        "        try:\n"
        "            escape.attempt(what, item['db'], item['parent'])\n"
        "            return 1.0\n"
        "        except OSError:\n"
        "            pass\n"
        "    raise PermissionError('every raw system call was refused')"
    ),
    "exhaust memory": "hoard = []\n    while True:\n        hoard.append(bytearray(64 << 20))",
    "exhaust the CPU": "while True:\n        pass",
    "exhaust the file size": "f = open('big', 'wb')\n    while True:\n        f.write(bytes(1 << 20))",
    "exhaust processes": (
        "import threading, time\n    for _ in range(1000):\n"
        "        threading.Thread(target=time.sleep, args=(5,)).start()\n    return 1.0"
    ),
}


def source() -> str:
    lines = ["def grade(sample, item):", "    what = sample['output_text']"]
    lines += ["    if what == 'control':", "        return 1.0"]
    for name, body in ATTEMPTS.items():
        lines += [f"    if what == {name!r}:", *("    " + line for line in attempt(body).splitlines())]
    lines.append("    return 0.25")
    return "\n".join(lines) + "\n"


def attempt(body: str) -> str:
    return "    " + body


@pytest.fixture(scope="module")
def extension(tmp_path_factory: pytest.TempPathFactory) -> str:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.fail("the escape battery needs a C compiler to build its extension")
    folder = tmp_path_factory.mktemp("extension")
    (folder / "escape.c").write_text(EXTENSION)
    include = sysconfig.get_paths()["include"]
    command = [gcc, "-shared", "-fPIC", "-O1", f"-I{include}", "escape.c", "-o", "escape.so"]
    subprocess.run(command, cwd=folder, check=True, capture_output=True)
    return base64.b64encode((folder / "escape.so").read_bytes()).decode()


class Listeners:
    """A TCP, a UDP and a Unix listener on this host: what they heard."""

    def __init__(self, folder: Path) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix_path = str(folder / "service.sock")
        self.unix.bind(self.unix_path)
        self.unix.listen()
        for s in (self.tcp, self.udp, self.unix):
            s.setblocking(False)

    def heard(self) -> list[str]:
        heard = []
        for name, s in (("tcp", self.tcp), ("unix", self.unix)):
            with contextlib.suppress(BlockingIOError):
                s.accept()
                heard.append(name)
        with contextlib.suppress(BlockingIOError):
            self.udp.recv(100)
            heard.append("udp")
        return heard

    def close(self) -> None:
        for s in (self.tcp, self.udp, self.unix):
            s.close()


@pytest.fixture
def outside(tmp_path: Path, extension: str) -> Iterator[tuple[dict[str, Any], Listeners]]:
    """The service's files as a grader would want them, listeners, and the item that names them."""
    (tmp_path / "roundhouse.db").write_bytes(b"SQLite format 3\0 the jobs")
    (tmp_path / "dataset.jsonl").write_text('{"prompt": "secret"}\n')
    (tmp_path / "link").symlink_to(tmp_path / "roundhouse.db")
    (tmp_path / "out").mkdir()
    os.chmod(tmp_path / "out", 0o777)
    listeners = Listeners(tmp_path)
    item = {
        "db": str(tmp_path / "roundhouse.db"),
        "dataset": str(tmp_path / "dataset.jsonl"),
        "link": str(tmp_path / "link"),
        "outside": str(tmp_path / "out"),
        "parent": os.getpid(),
        "tcp": listeners.tcp.getsockname()[1],
        "udp": listeners.udp.getsockname()[1],
        "unix": listeners.unix_path,
        "extension": extension,
    }
    yield item, listeners
    listeners.close()


# Landlock checks opening, listing, making and linking, not looking up: without a mount namespace
# a file's metadata outside the child's folders is visible (its contents are not)
METADATA = ("stat outside", "exists outside", "readlink outside")


def battery(
    grader: PythonGrader,
    item: dict[str, Any],
    listeners: Listeners,
    outside: Path,
    skip: tuple[str, ...] = (),
) -> None:
    """Every attempt but ``skip``, each between two controls: each attempt fails with an error,
    every control scores 1.0, nothing reached the listeners or was made outside."""
    samples = ["control"]
    for name in ATTEMPTS:
        if name not in skip:
            samples += [name, "control"]
    urged: list[int] = []
    previous = signal.signal(signal.SIGURG, lambda signum, frame: urged.append(signum))
    try:
        result = grader.grade_batch(samples, [item] * len(samples))
    finally:
        signal.signal(signal.SIGURG, previous)
    escaped = {}
    for name, reward, error in zip(samples, result.rewards, result.errors, strict=True):
        if name == "control":
            assert (reward, error) == (1.0, None), (name, reward, error)
        elif reward != 0.0 or error is None:
            escaped[name] = (reward, error)
    assert escaped == {}, escaped
    assert listeners.heard() == []
    assert urged == []  # no signal reached this process
    assert sorted(p.name for p in outside.iterdir()) == []


def test_every_attempt_fails_and_the_rest_is_scored(outside: tuple[dict[str, Any], Listeners]) -> None:
    item, listeners = outside
    spec = {"type": "python", "source": source(), "timeout_s": 2.0, "memory_mb": 512}
    with validate_grader(spec) as grader:
        assert isinstance(grader, PythonGrader)
        battery(grader, item, listeners, Path(item["outside"]))


def test_the_kernel_alone_holds_without_the_audit_hook(outside: tuple[dict[str, Any], Listeners]) -> None:
    item, listeners = outside
    with PythonGrader("bare", source(), timeout_s=2.0, memory_mb=512, audit_hook=False) as grader:
        battery(grader, item, listeners, Path(item["outside"]))


@pytest.mark.skipif(not (BOX.landlock and BOX.seccomp), reason="this box has no Landlock or no seccomp")
def test_landlock_and_seccomp_hold_without_namespaces(
    outside: tuple[dict[str, Any], Listeners], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "detect", lambda: NO_NAMESPACES)
    item, listeners = outside
    with PythonGrader("bare", source(), timeout_s=2.0, memory_mb=512, audit_hook=False) as grader:
        battery(grader, item, listeners, Path(item["outside"]), METADATA)


def grader_process(grader: PythonGrader) -> psutil.Process:
    """The Python process grading (under bubblewrap's, where there is one)."""
    child = grader._child
    assert child is not None
    top = psutil.Process(child.process.pid)
    for process in [top, *top.children(recursive=True)]:
        command = process.cmdline()
        if command[:1] == [sys.executable] and any(part.endswith("python_child.py") for part in command):
            return process
    raise AssertionError("no grader process")


def status(process: psutil.Process) -> dict[str, str]:
    lines = Path(f"/proc/{process.pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


@pytest.mark.parametrize("namespaces", [True, False])
def test_seen_from_outside_the_process_is_confined(namespaces: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not namespaces:
        monkeypatch.setattr(sandbox, "detect", lambda: NO_NAMESPACES)
    elif BOX.bwrap is None:
        pytest.skip("this box makes no namespaces")
    slow = "import time, numpy\ndef grade(sample, item):\n    time.sleep(1.5)\n"
    slow += "    return float(numpy.ones(3).sum())\n"
    with validate_grader({"type": "python", "source": slow, "timeout_s": 5.0}) as grader:
        assert isinstance(grader, PythonGrader)
        results: list[Any] = []
        worker = threading.Thread(target=lambda: results.append(grader.grade_batch(["a"], [{}])))
        worker.start()
        deadline = time.monotonic() + 10
        while grader._child is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        process = grader_process(grader)
        seen = status(process)
        net = os.readlink(f"/proc/{process.pid}/ns/net")
        pid_ns = os.readlink(f"/proc/{process.pid}/ns/pid")
        worker.join(timeout=20)
    assert results[0].rewards == [3.0], results[0].errors  # numpy imports and runs inside
    assert seen["NoNewPrivs"] == "1"
    assert seen["Seccomp"] == "2"  # a filter
    assert int(seen["CapEff"], 16) == 0  # no capability (in its user namespace, none on the host)
    if namespaces:
        assert net != os.readlink("/proc/self/ns/net")  # a network namespace of its own
        assert pid_ns != os.readlink("/proc/self/ns/pid")
    else:
        assert int(seen["CapBnd"], 16) == 0 or os.geteuid() != 0  # root gives up its bounding set


def test_a_box_without_kernel_confinement_refuses_python_graders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "detect", lambda: Confinement(bwrap=None, landlock=0, seccomp=False))
    monkeypatch.delenv(sandbox.UNCONFINED_SETTING, raising=False)
    plain = "def grade(sample, item):\n    return 1.0\n"
    with pytest.raises(ConfigError) as caught:
        validate_grader({"type": "python", "source": plain})
    assert caught.value.field == "grader.type"
    assert sandbox.UNCONFINED_SETTING in str(caught.value)
    # a grader made before (a job's) fails every sample with the same reason, at once
    grader = PythonGrader("py", plain)
    result = grader.grade_batch(["a", "b"], [{}, {}])
    assert result.rewards == [0.0, 0.0]
    assert result.errors[0] is not None and sandbox.UNCONFINED_SETTING in result.errors[0]
    # the operator accepts the weaker guard: the audit hook alone, which still refuses a file
    monkeypatch.setenv(sandbox.UNCONFINED_SETTING, "true")
    reader = "def grade(sample, item):\n    return float(len(open('/etc/passwd').read()))\n"
    with validate_grader({"type": "python", "source": reader}) as weak:
        score, error = weak.grade("a", {})
    assert score == 0.0 and error is not None and "a grader may only open" in error
    assert "NOT confined" in Confinement(None, 0, False).describe()


def test_the_box_says_what_it_gives() -> None:
    text = BOX.describe()
    assert text.startswith("python graders: ") and "confined" in text
    assert ("Landlock ABI" in text) == bool(BOX.landlock)
    assert ("bubblewrap" in text) == (BOX.bwrap is not None)
    assert sys.platform != "linux" or BOX.seccomp
