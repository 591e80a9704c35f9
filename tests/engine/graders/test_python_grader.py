"""The python grader: grade(sample, item) in a child process with a time and a memory limit, no
network, no environment, no file outside its own directory; a failing sample scores 0 with its
error and never spoils the others."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import engine.graders.python as python_grader
from engine.errors import ConfigError
from engine.graders import GradeResult, validate_grader
from engine.graders.python import GRACE_S, PythonGrader

REPO_FILE = str(Path(__file__).resolve().parents[3] / "README.md")
SECRET = "ROUNDHOUSE_GRADER_TEST_SECRET"
# each sample's text picks what grade() does
SOURCE = """
import os


def grade(sample, item):
    what = sample["output_text"]
    if what == "crash":
        return 1 / 0
    if what == "loop":
        while True:
            pass
    if what == "stubborn":  # swallows the alarm: the parent has to kill the child
        while True:
            try:
                sum(range(10**12))
            except BaseException:
                pass
    if what == "memory":
        hoard = []
        while True:
            hoard.append(bytearray(50 << 20))
    if what == "passwd":
        return len(open("/etc/passwd").read())
    if what == "repo":
        return len(open(item["path"]).read())
    if what == "listing":
        return len(os.listdir("/"))
    if what == "environ":
        return 1.0 if item["secret"] in os.environ else 0.5
    if what == "socket":
        import socket
        socket.create_connection(("127.0.0.1", 9))
        return 1.0
    if what == "raw socket":
        import _socket
        _socket.socket()
        return 1.0
    if what == "subprocess":
        import subprocess
        return float(subprocess.run(["true"]).returncode)
    if what == "system":
        return float(os.system("true"))
    if what == "kill parent":
        os.kill(os.getppid(), 9)
    if what == "exit":
        os._exit(3)
    if what == "text":
        return "1.0"
    if what == "nan":
        return float("nan")
    if what == "local file":
        with open("scratch.txt", "w") as f:
            f.write("four")
        return float(len(open("scratch.txt").read()))
    if what == "print":
        print("noise on stdout")
        return 0.25
    return 1.0 if what == item["answer"] else 0.0
"""


@pytest.fixture(scope="module")
def grader() -> Any:
    with validate_grader({"type": "python", "name": "py", "source": SOURCE, "timeout_s": 1.0}) as made:
        assert isinstance(made, PythonGrader)
        yield made


def run(grader: PythonGrader, samples: list[str], **item: Any) -> GradeResult:
    base = {"answer": "4", "path": REPO_FILE, "secret": SECRET}
    return grader.grade_batch(samples, [base | item] * len(samples))


def test_it_scores_what_grade_returns(grader: PythonGrader) -> None:
    result = run(grader, ["4", "5", "local file", "print"])
    assert result.rewards == [1.0, 0.0, 4.0, 0.25]
    assert result.errors == [None, None, None, None]
    assert result.sub_rewards == {"py": [1.0, 0.0, 4.0, 0.25]}
    assert (grader.name, grader.type) == ("py", "python")


def test_the_item_and_sample_are_openai_shaped() -> None:
    source = (
        "def grade(sample, item):\n"
        "    assert sample['output_json'] == {'x': 2} and sample['choices'][0]['message']['content']\n"
        "    return sample['output_json']['x'] * item['weight']\n"
    )
    with validate_grader({"type": "python", "source": source}) as grader:
        assert grader.grade_batch(['{"x": 2}'], [{"weight": 1.5}]).rewards == [3.0]


def test_a_crash_scores_0_with_its_error(grader: PythonGrader) -> None:
    result = run(grader, ["crash", "4"])
    assert result.rewards == [0.0, 1.0]
    assert result.errors[0] == "ZeroDivisionError: division by zero (line 8)"
    assert result.error_kinds == ["runtime", None]


def test_not_a_number_scores_0(grader: PythonGrader) -> None:
    result = run(grader, ["text", "nan"])
    assert result.rewards == [0.0, 0.0]
    assert result.errors == ["grade returned str, not a number", "grade returned nan, not a finite number"]


def test_an_endless_loop_times_out_within_the_limit(grader: PythonGrader) -> None:
    start = time.monotonic()
    result = run(grader, ["loop", "4"])
    assert time.monotonic() - start < 1.0 + GRACE_S + 3.0  # the child's start included
    assert result.rewards == [0.0, 1.0]
    assert result.errors[0] == "timed out after 1 s"
    assert result.error_kinds[0] == "timeout"


def test_a_loop_that_swallows_the_alarm_is_killed_and_the_rest_still_graded(grader: PythonGrader) -> None:
    start = time.monotonic()
    result = run(grader, ["4", "stubborn", "5", "4"])
    assert time.monotonic() - start < 1.0 + GRACE_S + 6.0  # two children's starts included
    assert result.rewards == [1.0, 0.0, 0.0, 1.0]
    assert result.errors == [None, "timed out after 1 s", None, None]


def test_a_memory_hog_scores_0() -> None:
    spec = {"type": "python", "source": SOURCE, "timeout_s": 10.0, "memory_mb": 256}
    with validate_grader(spec) as grader:
        assert isinstance(grader, PythonGrader)
        result = run(grader, ["memory", "4"])
    assert result.rewards == [0.0, 1.0]
    assert result.errors[0] == "MemoryError: the grader ran out of its memory limit (line 21)"


@pytest.mark.parametrize("what", ["passwd", "repo", "listing"])
def test_files_outside_its_directory_are_refused(grader: PythonGrader, what: str) -> None:
    result = run(grader, [what])
    assert result.rewards == [0.0]
    assert result.errors[0] is not None and result.errors[0].startswith("PermissionError: a grader may only")


def test_the_services_environment_is_not_there(grader: PythonGrader, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET, "hunter2")
    assert run(grader, ["environ"]).rewards == [0.5]  # graded, and the secret absent


@pytest.mark.parametrize("what", ["socket", "raw socket", "subprocess", "system", "kill parent"])
def test_network_processes_and_signals_are_refused(grader: PythonGrader, what: str) -> None:
    result = run(grader, [what])
    assert result.rewards == [0.0]
    error = result.errors[0]
    assert error is not None and ("PermissionError" in error or "a grader may not import" in error), error


def test_a_sample_that_kills_the_child_fails_alone(grader: PythonGrader) -> None:
    result = run(grader, ["4", "exit", "4", "exit", "5", "4"])
    assert result.rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert result.errors[1] == "the grader's process ended: it exited with status 3"
    assert result.error_kinds[1] == "crashed"
    assert [e is None for e in result.errors] == [True, False, True, False, True, True]


# a number drawn once a child (its process id is the same in every child in a PID namespace)
CHILD_ID = "import random\nID = random.random()\ndef grade(sample, item):\n    return ID\n"


def test_one_child_grades_a_whole_batch(grader: PythonGrader) -> None:
    with validate_grader({"type": "python", "source": CHILD_ID}) as ids:
        first = ids.grade_batch(["a"] * 20, [{}] * 20).rewards
        second = ids.grade_batch(["a"] * 2, [{}] * 2).rewards
    assert len(set(first)) == 1
    assert len(set(second)) == 1 and second[0] != first[0]  # a child per batch


def test_no_child_is_left_behind_and_its_directory_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []

    class Recorded(python_grader._Child):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(python_grader, "_Child", Recorded)
    source = "import os\ndef grade(sample, item):\n    return float(len(os.getcwd()))\n"
    with validate_grader({"type": "python", "source": source}) as grader:
        assert grader.grade_batch(["a"], [{}]).rewards[0] > 0
    assert made  # the check's child and the batch's
    for child in made:
        assert child.process.poll() is not None
        for process in psutil.process_iter():  # nothing the child started is left either
            with contextlib.suppress(psutil.Error):
                assert child.workdir not in process.cwd()
        assert not Path(child.workdir).exists()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def grade(sample, item)\n    return 1", "grader.source: SyntaxError: expected ':' (line 1)"),
        ("def score(sample, item):\n    return 1", "grader.source: the source defines no function grade"),
        ("def grade(sample):\n    return 1", "grader.source: grade must take two arguments"),
        ("import os\nopen('/etc/passwd')\n", "grader.source: PermissionError: a grader may only open"),
        ("while True:\n    pass\n", "grader.source: running the source took longer than 0.5 s"),
    ],
)
def test_validation_runs_the_source_in_a_child(source: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate_grader({"type": "python", "source": source, "timeout_s": 0.5})
    assert caught.value.field == "grader.source"
    assert str(caught.value).startswith(message), str(caught.value)


ESCAPES = {
    # a process made without subprocess's audit event, an interpreter without the hook
    "fork_exec": "import _posixsubprocess",
    "subprocess internals": "import subprocess",
    "sub-interpreter": "import _xxsubinterpreters",
    "ctypes": "import ctypes",
    "C API tests": "import _testcapi",
    "ctypes again": "import sys; sys.modules.pop('ctypes', None); import ctypes",
    # hand-made bytecode
    "code.replace": "grade.__code__.replace(co_consts=(None,))",
    "marshal": "import marshal; marshal.loads(marshal.dumps(compile('1', 'x', 'eval')))",
    "import's own reader": (
        "import marshal, importlib._bootstrap_external as b; "
        "b._compile_bytecode(memoryview(marshal.dumps(compile('1', 'x', 'eval'))))"
    ),
    "a hard link": "import os; os.link('/etc/passwd', 'passwd')",
    # a signal by pidfd raises no audit event: the function is gone, and posix cannot come back
    "a pidfd": "import os; os.pidfd_open(os.getppid())",
    "a fresh posix": "import sys; del sys.modules['posix']; import posix; posix.pidfd_open(1)",
    # root may make a device node (os.mknod raises no audit event): opening it is refused
    "a device": (
        "import os, stat; os.mknod('null', 0o600 | stat.S_IFCHR, os.makedev(1, 3)); open('null', 'rb')"
    ),
    "a symbolic link": "import os; os.symlink('/etc/passwd', 'passwd')",
}


@pytest.mark.parametrize("escape", list(ESCAPES))
def test_ways_around_the_audit_hook_are_refused(escape: str) -> None:
    source = f"def grade(sample, item):\n    {ESCAPES[escape]}\n    return 1.0\n"
    with validate_grader({"type": "python", "source": source}) as grader:
        score, error = grader.grade("x", {})
    assert score == 0.0
    refused_imports = (
        "fork_exec",
        "subprocess internals",
        "sub-interpreter",
        "ctypes",
        "C API tests",
        "ctypes again",
    )
    if escape in refused_imports:  # an ImportError, as for a missing module (numpy does without ctypes)
        assert error is not None and error.startswith("ImportError: a grader may not import"), error
    elif escape == "a pidfd":
        assert error == "AttributeError: module 'os' has no attribute 'pidfd_open' (line 2)"
    elif escape == "a device":  # the kernel refuses mknod (seccomp, or no root)
        assert error is not None and error.startswith("PermissionError: [Errno 1]"), error
    else:
        assert error is not None and error.startswith("PermissionError: a grader may not"), error


def test_the_standard_library_and_installed_packages_import() -> None:
    source = (
        "import dataclasses, fractions, json, statistics, difflib, jsonschema\n"
        "@dataclasses.dataclass\n"
        "class Point:\n"
        "    x: int\n"
        "def grade(sample, item):\n"
        "    import decimal, unicodedata\n"
        "    return float(statistics.mean([Point(1).x, 3])) + float(fractions.Fraction(1, 2))\n"
    )
    with validate_grader({"type": "python", "source": source}) as grader:
        assert grader.grade("x", {}) == (2.5, None)


def test_close_stops_a_batch_in_progress() -> None:
    import threading

    source = "import time\ndef grade(sample, item):\n    time.sleep(0.3)\n    return 1.0\n"
    with validate_grader({"type": "python", "source": source, "timeout_s": 5}) as grader:
        results: list[GradeResult] = []
        worker = threading.Thread(target=lambda: results.append(grader.grade_batch(["a"] * 50, [{}] * 50)))
        worker.start()
        time.sleep(1.0)
        grader.close()
        worker.join(timeout=10)
        assert not worker.is_alive()
    rewards = results[0].rewards
    assert 0 < sum(rewards) < 50 and len(rewards) == 50
    assert results[0].errors[-1] == "the grader was closed"


def test_an_error_message_is_always_unicode_text() -> None:
    source = "def grade(sample, item):\n    raise ValueError('\\ud800 caf\\u00e9')\n"
    with validate_grader({"type": "python", "source": source, "image_tag": "2025-05-08"}) as grader:
        assert grader.spec()["image_tag"] == "2025-05-08"  # OpenAI's field: accepted, not used
        score, error = grader.grade("x", {})
    assert score == 0.0
    assert error == "ValueError: \\ud800 caf\u00e9 (line 2)"
    assert error is not None and error.encode()


def test_a_score_beyond_float32_is_an_error_and_the_rest_is_scored() -> None:
    """A reward becomes a float32: 1e300 would be inf there, and the advantages NaN."""
    source = "def grade(sample, item):\n    return float(sample['output_text'])\n"
    with validate_grader({"type": "python", "source": source}) as grader:
        result = grader.grade_batch(["1e300", "3e38", "-1e39", "0.5"], [{}] * 4)
    assert result.rewards == [0.0, 3e38, 0.0, 0.5]
    assert result.errors[0] is not None and "beyond float32's range" in result.errors[0]
    assert result.errors[2] is not None and "beyond float32's range" in result.errors[2]
    assert result.error_kinds[:3] == ["runtime", None, "runtime"] and result.errors[3] is None
    # a combination of finite scores that overflows float32 is an error of the combined reward
    multi = {
        "type": "multi",
        "graders": {"big": {"type": "python", "source": source}},
        "calculate_output": "big * 1e10",
    }
    with validate_grader(multi) as combined:
        scores = combined.grade_batch(["1e30", "2"], [{}, {}])
    assert scores.rewards == [0.0, 2e10]
    assert scores.errors[0] is not None and "beyond float32's range" in scores.errors[0]
