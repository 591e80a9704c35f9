"""The metric points a tracker has not delivered yet, in the order the run logged them: the first
``limit`` in memory, the rest in a JSON-lines file under the run folder. What is left when the run
ends is written to that file too; the next run in the folder (a resume) sends it before its own.

Not thread-safe: its owner (``engine.tracking.background``) serialises the calls.
"""

from __future__ import annotations

import collections
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

SPOOL_DIR = "tracker-spool"  # in the run folder: one ``<tracker>.jsonl`` per tracker
READ_BACK = 1_000  # points read back from the file at a time


@dataclass(frozen=True)
class Point:
    """One step's metrics as the run logged them.

    Attributes:
        step: the run's step.
        metrics: the values by key.
        time_ms: when the run logged them (ms since the epoch); a point sent twice (a retry after
            a timeout the server did get, a spool replayed) carries the same time, so the second
            copy is the same record, which MLflow's database stores ignore.
    """

    step: int
    metrics: dict[str, float]
    time_ms: int

    def line(self) -> str:
        return json.dumps({"step": self.step, "time_ms": self.time_ms, "metrics": self.metrics}) + "\n"

    @classmethod
    def parse(cls, line: str) -> Point:
        """A point from its line; ValueError naming the field when the line is not one."""
        raw: Any = json.loads(line)  # NaN and Infinity come back as written
        if not isinstance(raw, dict):
            raise ValueError(f"a spooled point is an object, not {type(raw).__name__}")
        numbers: dict[str, int] = {}
        for name in ("step", "time_ms"):
            value = raw.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"a spooled point's {name} is an integer, not {value!r}")
            numbers[name] = value
        metrics = raw.get("metrics")
        if not isinstance(metrics, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in metrics.values()
        ):
            raise ValueError(f"a spooled point's metrics map names to numbers, not {metrics!r}")
        return cls(numbers["step"], {str(k): float(v) for k, v in metrics.items()}, numbers["time_ms"])


def step_ranges(steps: list[int], *, most: int = 8) -> str:
    """Steps as short ranges, ``[3, 4, 5, 9]`` -> ``"3-5, 9"``; past ``most`` ranges the middle
    ones are left out (``"…"``)."""
    ordered, parts, i = sorted(set(steps)), [], 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    if len(parts) > most:
        parts = [*parts[: most - 2], "…", parts[-1]]
    return ", ".join(parts)


class Spool:
    """A queue of points: memory up to ``limit``, then ``path``. Every point in memory comes
    before every point in the file; while the file holds some, new points join them there, and
    the file is read back once memory is empty."""

    def __init__(self, path: Path, *, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a tracker's queue holds at least 1 point, not {limit}")
        self.path, self.limit = path, limit
        self.memory: collections.deque[Point] = collections.deque()
        self.on_disk = 0  # points in the file not read back yet
        self.read_at = 0  # where the first of them starts
        self.unreadable = 0  # lines of the file that were not points (skipped)
        self.lost = 0  # points of the file that could not be read back (``lost_because`` says why)
        self.lost_because = ""
        self.writer: IO[str] | None = None
        self.inherited: list[int] = []  # the steps an earlier run left in the file
        if path.is_file():
            with path.open(encoding="utf-8") as f:
                for line in f:
                    try:
                        self.inherited.append(Point.parse(line).step)
                    except ValueError:  # a line cut short by a crash, say
                        self.unreadable += 1
            self.on_disk = len(self.inherited)
            if not self.on_disk:
                self._remove()

    def __len__(self) -> int:
        return len(self.memory) + self.on_disk

    def push(self, point: Point) -> bool:
        """Queue ``point``: True when it waits in memory, False when in the file.

        Raises:
            OSError: the file could not take it (the point is not queued).
        """
        if not self.on_disk and len(self.memory) < self.limit:
            self.memory.append(point)
            return True
        if self.writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.writer = self.path.open("a", encoding="utf-8")
            if self.writer.tell() and not self._ends_a_line():  # a last line cut short stays apart
                self.writer.write("\n")
        self.writer.write(point.line())
        self.writer.flush()
        self.on_disk += 1
        return False

    def head(self, *, points: int, metrics: int) -> list[Point]:
        """The first points (at most ``points``, and ``metrics`` values unless the first alone has
        more), left queued until ``done``."""
        if not self.memory and self.on_disk:
            self._read_back()
        out: list[Point] = []
        values = 0
        for point in self.memory:
            if out and (len(out) >= points or values + len(point.metrics) > metrics):
                break
            out.append(point)
            values += len(point.metrics)
        return out

    def done(self, count: int) -> None:
        """The first ``count`` points were delivered."""
        if count > len(self.memory):
            raise RuntimeError(f"{count} points delivered but only {len(self.memory)} were handed out")
        for _ in range(count):
            self.memory.popleft()

    def dump(self) -> list[int]:
        """Move every queued point into the file, in order; returns their steps.

        Raises:
            OSError: the file could not be written (the points stay queued).
        """
        if not self:
            return []
        if self.writer is not None:
            self.writer.flush()
        steps = [p.step for p in self.memory]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as out:
            out.writelines(p.line() for p in self.memory)
            if self.on_disk:  # then the file's points not read back yet, line by line
                with self.path.open(encoding="utf-8") as f:
                    f.seek(self.read_at)
                    for line in f:
                        with contextlib.suppress(ValueError):
                            steps.append(Point.parse(line).step)
                            out.write(line.rstrip("\n") + "\n")
        self._close_writer()
        tmp.replace(self.path)
        self.memory.clear()
        self.on_disk, self.read_at = len(steps), 0
        return steps

    def _ends_a_line(self) -> bool:
        with self.path.open("rb") as f:
            f.seek(-1, 2)
            return f.read(1) == b"\n"

    def _read_back(self) -> None:
        try:
            if self.writer is not None:
                self.writer.flush()
            with self.path.open(encoding="utf-8") as f:
                f.seek(self.read_at)
                while self.on_disk and len(self.memory) < min(self.limit, READ_BACK):
                    line = f.readline()
                    if not line:  # the file ended before its count: someone cut it short
                        raise OSError(f"{self.path.name} ended {self.on_disk} point(s) early")
                    with contextlib.suppress(ValueError):  # counted when the file was opened
                        self.memory.append(Point.parse(line))
                        self.on_disk -= 1
                self.read_at = f.tell()
        except OSError as exc:
            self.lost, self.lost_because = self.lost + self.on_disk, str(exc)
            self.on_disk = 0
        if not self.on_disk:
            self._remove()

    def _close_writer(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(OSError):
                self.writer.close()
            self.writer = None

    def _remove(self) -> None:
        """Every point of the file is in memory: the file goes (and its folder, when empty)."""
        self._close_writer()
        self.on_disk = self.read_at = 0
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()
