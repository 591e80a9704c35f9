"""OpenAI's ``python`` grader: ``source`` defines ``grade(sample, item) -> float``, run in a child
process (``engine.graders.python_child``: no network, no environment, no file outside its own
temporary directory, limited memory and CPU time).

A batch is graded by one child, one sample at a time, each under a time limit (``timeout_s``):
the child's alarm stops a slow call, and a child that does not answer ``GRACE_S`` after that is
killed. A sample that fails scores 0 with its error; a sample that kills the child (or makes it
be killed) fails alone, and a fresh child grades the rest. Checking a grader (``validate_grader``)
runs its source in a child too: the service process never compiles or runs user code.

Ours besides OpenAI's fields: ``timeout_s`` (per sample, default 5, at most 60) and
``memory_mb`` (the child's address space, default 1024). ``image_tag`` is accepted and ignored.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

import engine.graders.sandbox as sandbox
from engine.errors import ConfigError
from engine.graders.base import ErrorKind, Grader, Scores, short, unscorable
from engine.graders.fields import DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT_S
from engine.graders.sandbox import Confinement
from engine.graders.spec import PythonSpec

STARTUP_S = 10.0  # a child's start, on top of the time its source's top level may take
GRACE_S = 1.0  # how late past the time limit an answer may come before the child is killed
MAX_ANSWER = 1 << 20  # bytes of one answer line


class _Gone(Exception):
    """The child died, stopped answering or broke the protocol; it is killed."""

    def __init__(self, message: str, kind: ErrorKind = "crashed") -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


class _Child:
    """One child process and the pipes to it, confined as ``confinement`` says."""

    def __init__(
        self, memory_bytes: int, cpu_seconds: int, confinement: Confinement, audit: bool = True
    ) -> None:
        self.workdir = tempfile.mkdtemp(prefix="roundhouse-grader-")
        # what the child writes to stderr (and what user code prints): read when it dies
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed by cleanup()
        self.buffer = bytearray()
        self.in_namespaces = confinement.bwrap is not None  # bubblewrap reports a signal as 128 + it
        arguments = [str(memory_bytes), str(cpu_seconds)]
        try:
            self.process = subprocess.Popen(
                sandbox.command(confinement, self.workdir, arguments, audit=audit),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log,
                cwd=self.workdir,
                env=dict(sandbox.CHILD_ENV),
                close_fds=True,
                start_new_session=True,
            )
        except BaseException:
            self.cleanup()
            raise
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin, self.stdout = self.process.stdin.fileno(), self.process.stdout.fileno()
        os.set_blocking(self.stdin, False)

    def request(self, message: dict[str, Any], deadline: float, late: str) -> dict[str, Any]:
        """Send ``message`` and read the answer by ``deadline`` (``late``: the error if it does not
        come in time). Raises ``_Gone`` when the child has to go."""
        data = json.dumps(message, default=str).encode() + b"\n"
        view = memoryview(data)
        while view:
            if not select.select([], [self.stdin], [], max(0.0, deadline - time.monotonic()))[1]:
                raise _Gone(late, "timeout")
            try:
                view = view[os.write(self.stdin, view) :]
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError) as exc:
                raise _Gone(self.death(f"could not be written to ({exc})")) from exc
        line = self.read_line(deadline, late)
        try:
            answer = json.loads(line)
        except ValueError as exc:
            raise _Gone("the grader's process answered something that is not JSON") from exc
        if not isinstance(answer, dict):
            raise _Gone("the grader's process answered something that is not an object")
        return answer

    def read_line(self, deadline: float, late: str) -> bytes:
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.stdout], [], [], left)[0]:
                raise _Gone(late, "timeout")
            chunk = os.read(self.stdout, 1 << 16)
            if not chunk:
                raise _Gone(self.death("ended"))
            self.buffer += chunk
            if len(self.buffer) > MAX_ANSWER:
                raise _Gone("the grader's process answered more than 1 MiB at once")
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        return line

    def death(self, what: str) -> str:
        """Why the child is gone: its exit status and the last line it wrote to stderr."""
        try:
            code = self.process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return f"the grader's process {what}"
        if self.in_namespaces and code > 128 and code - 128 in signal.valid_signals():
            code = 128 - code  # bubblewrap's exit status for a child killed by a signal
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            how = {
                "SIGXCPU": "its CPU time limit",
                "SIGXFSZ": "its file size limit",
                "SIGKILL": "SIGKILL (out of memory?)",
            }.get(name, name)
            status = f"was killed by {how}"
        else:
            status = f"exited with status {code}"
        last = self.last_log_line()
        return f"the grader's process {what}: it {status}" + (f"; it wrote: {last}" if last else "")

    def last_log_line(self) -> str:
        try:
            size = self.log.seek(0, os.SEEK_END)
            self.log.seek(max(0, size - 2048))
            lines = self.log.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            return ""
        return short(lines[-1], 300) if lines else ""

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                self.process.kill()
        self.process.wait()
        self.cleanup()

    def stop(self) -> None:
        """Close the pipe (the child's loop ends), then make sure it is gone."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=GRACE_S)
        self.kill()

    def cleanup(self) -> None:
        process = getattr(self, "process", None)
        for stream in (process and process.stdin, process and process.stdout, self.log):
            if stream:
                with contextlib.suppress(OSError):
                    stream.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class PythonGrader(Grader):
    """OpenAI's ``python`` grader (see the module's docstring)."""

    type = "python"

    def __init__(
        self,
        name: str,
        source: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_mb: int = DEFAULT_MEMORY_MB,
        image_tag: str | None = None,
        audit_hook: bool = True,
    ) -> None:
        super().__init__(name)
        self.source, self.timeout_s, self.memory_mb, self.image_tag = source, timeout_s, memory_mb, image_tag
        # False only in the tests that show the kernel's layers hold without the Python one
        self.audit_hook = audit_hook
        self._lock = threading.Lock()  # one batch at a time
        self._child: _Child | None = None
        self._closed = 0  # close() calls: a batch stops starting children when it changes

    @classmethod
    def from_spec(cls, spec: PythonSpec, *, name: str | None = None, field: str = "grader") -> PythonGrader:
        """The grader, its source run once in a child to find ``grade``.

        Raises:
            ConfigError: this machine cannot confine a child (``<field>.type``), or the source
                defines no ``grade(sample, item)`` (``<field>.source``).
        """
        refused = sandbox.refusal(sandbox.detect())
        if refused is not None:
            raise ConfigError(f"{field}.type", f"{field}.type: {refused}", value="python")
        grader = cls(
            name or spec.name or cls.type,
            spec.source,
            timeout_s=spec.timeout_s,
            memory_mb=spec.memory_mb,
            image_tag=spec.image_tag,
        )
        error = grader.check()
        if error is not None:
            raise ConfigError(f"{field}.source", f"{field}.source: {error}", value=None)
        return grader

    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"type": self.type, "name": self.name, "source": self.source}
        if self.image_tag is not None:
            spec["image_tag"] = self.image_tag
        return spec | {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb}

    def check(self) -> str | None:
        """Run the source in a child: None when it defines ``grade(sample, item)``, else why not."""
        with self._lock:
            child, error, _ = self._start(0)
            if child is not None:
                child.stop()
            return error

    def scores(self, samples: list[dict[str, Any]], items: Sequence[Mapping[str, Any]]) -> Scores:
        out = Scores([], [], [])
        with self._lock:
            closed = self._closed
            child: _Child | None = None
            try:
                for index, (sample, item) in enumerate(zip(samples, items, strict=True)):
                    if child is None:
                        if self._closed != closed:
                            _fail_rest(out, len(samples), "the grader was closed", "other")
                            break
                        child, error, kind = self._start(len(samples) - index)
                        if child is None:
                            _fail_rest(out, len(samples), error or "", kind or "crashed")
                            break
                    value, error, kind, alive = self._grade(child, index, sample, item)
                    out.values.append(value)
                    out.errors.append(error)
                    out.kinds.append(kind)
                    if not alive:
                        child.kill()
                        child = self._child = None
            finally:
                if child is not None:
                    child.stop()
                self._child = None
        return out

    def close(self) -> None:
        """Kill the child of a batch being graded (its remaining samples fail)."""
        self._closed += 1
        child = self._child
        if child is not None and child.process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(child.process.pid, signal.SIGKILL)

    def _start(self, remaining: int) -> tuple[_Child | None, str | None, ErrorKind | None]:
        """A child with the source loaded, for ``remaining`` samples; or (None, why, kind)."""
        confinement = sandbox.detect()
        refused = sandbox.refusal(confinement)
        if refused is not None:
            return None, refused, "other"
        cpu = math.ceil(STARTUP_S + (remaining + 1) * (self.timeout_s + GRACE_S))
        try:
            child = _Child(self.memory_mb << 20, cpu, confinement, audit=self.audit_hook)
        except OSError as exc:
            return None, f"could not start the grader's process: {exc}", "crashed"
        self._child = child
        deadline = time.monotonic() + STARTUP_S + self.timeout_s + GRACE_S
        token = secrets.token_hex(8)
        message = {"op": "load", "id": token, "source": self.source, "timeout": self.timeout_s}
        late = f"loading the source took longer than {self.timeout_s:g} s"
        try:
            answer = child.request(message, deadline, late)
        except _Gone as exc:
            child.kill()
            self._child = None
            return None, short(str(exc)), exc.kind
        if answer.get("id") != token:
            child.kill()
            self._child = None
            return None, "the grader's process answered out of turn", "crashed"
        if answer.get("confined") != confinement.layers():
            child.kill()
            self._child = None
            return None, f"the grader's process is not confined ({answer.get('confined')!r})", "crashed"
        if answer.get("ok") is not True:
            child.stop()
            self._child = None
            return None, short(str(answer.get("error") or "the source could not be loaded")), "runtime"
        return child, None, None

    def _grade(
        self, child: _Child, index: int, sample: dict[str, Any], item: Mapping[str, Any]
    ) -> tuple[float, str | None, ErrorKind | None, bool]:
        """One sample: (score, error, kind, whether the child may grade the next one)."""
        deadline = time.monotonic() + self.timeout_s + GRACE_S
        token = f"{index}-{secrets.token_hex(8)}"  # what user code writing to the pipe cannot know
        message = {"op": "grade", "id": token, "sample": sample, "item": item}
        try:
            answer = child.request(message, deadline, f"timed out after {self.timeout_s:g} s")
        except _Gone as exc:
            return 0.0, short(str(exc)), exc.kind, False
        except (ValueError, TypeError, RecursionError) as exc:  # not sent: the child waits on
            return 0.0, short(f"the sample or its item is not JSON: {exc}"), "other", True
        if answer.get("id") != token:
            return 0.0, "the grader's process answered out of turn", "crashed", False
        score = answer.get("score")
        if "error" in answer or isinstance(score, bool) or not isinstance(score, int | float):
            kind: ErrorKind = "timeout" if answer.get("kind") == "timeout" else "runtime"
            return 0.0, short(str(answer.get("error") or "grade returned no number")), kind, True
        problem = unscorable(float(score))
        if problem is not None:
            return 0.0, f"grade returned {score!r}: {problem}", "runtime", True
        return float(score), None, None, True


def _fail_rest(out: Scores, total: int, error: str, kind: ErrorKind) -> None:
    while len(out.values) < total:
        out.values.append(0.0)
        out.errors.append(error)
        out.kinds.append(kind)
