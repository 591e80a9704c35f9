"""The event core of the schedule simulator: ops with pre-parts, fixed per-worker orders, hops.

Pure Python: nothing here imports torch. An :class:`Op` runs on one worker, on its compute lane or on its
upload lane (weight uploads, which overlap compute). Each lane runs its ops one at a time in the order
they were added, without preemption or overtaking. An op's main part starts at the later of

- the end of the lane's previous op plus the op's pre-part, and
- each producer's end, plus ``hop`` when the producer ran on another worker;

and, for producers of the pre-part (``pre_deps``), their end plus hop plus the pre-part. The pre-part
sits immediately before the main part. Times are as soon as possible, hence unique.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

OP_KINDS = ("forward", "fused", "backward", "upload")


class Op(NamedTuple):
    """One contiguous block of work on one worker."""

    key: Hashable
    worker: int
    main: float
    pre: float = 0.0  # work needing only the worker (recompute, the LM-head forward); runs right before main
    deps: tuple[Hashable, ...] = ()  # producers the main part waits for
    pre_deps: tuple[Hashable, ...] = ()  # producers the pre-part waits for
    kind: str = "forward"  # "forward" | "fused" | "backward" | "upload"
    label: str = ""

    @property
    def lane(self) -> str:
        """ "upload" for weight uploads, "compute" for everything else."""
        return "upload" if self.kind == "upload" else "compute"


class OpTime(NamedTuple):
    """When an op ran: pre-part from ``start`` to ``main_start``, main part from there to ``end``."""

    op: Op
    start: float
    main_start: float
    end: float


class Timeline:
    """An as-soon-as-possible timeline that ops are added to in batches.

    Ops of later batches may depend on ops of earlier ones (never the reverse), so a schedule whose next
    step depends on simulated times (such as RoundPipe picking the next round's first worker) can be
    built round by round.
    """

    def __init__(self, *, num_workers: int, hop: float) -> None:
        """Start an empty timeline.

        Args:
            num_workers: N >= 1.
            hop: latency added to a dependency whose producer ran on another worker (>= 0).

        Raises:
            ValueError: ``num_workers`` or ``hop`` out of range.
        """
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 1")
        if not (isinstance(hop, int | float) and math.isfinite(hop) and hop >= 0):
            raise ValueError(f"hop={hop!r} must be a finite number >= 0")
        self.num_workers = num_workers
        self.hop = float(hop)
        self.times: dict[Hashable, OpTime] = {}
        self.free: dict[tuple[int, str], float] = {}

    def last_end(self, worker: int) -> float:
        """End of the last compute op added to ``worker`` (0 when it has none)."""
        return self.free.get((worker, "compute"), 0.0)

    def add(self, ops: Iterable[Op]) -> None:
        """Add a batch of ops; each lane runs them after its earlier ops, in the order given.

        Args:
            ops: the ops; their producers are ops of this batch or of earlier ones.

        Raises:
            ValueError: a duplicate key, a worker outside ``[0, N)``, a negative or non-finite duration,
                a producer that no op provides, or an order in which the workers would wait on each other
                forever (names the ops each stuck worker waits at).
        """
        keys: set[Hashable] = set()
        queues: dict[tuple[int, str], deque[Op]] = {}
        for op in ops:
            self._check(op)
            if op.key in keys or op.key in self.times:
                raise ValueError(f"op key {op.key!r} appears twice")
            keys.add(op.key)
            queues.setdefault((op.worker, op.lane), deque()).append(op)
        for queue in queues.values():
            for op in queue:
                for dep in (*op.deps, *op.pre_deps):
                    if dep not in keys and dep not in self.times:
                        raise ValueError(f"op {op.key!r} depends on {dep!r}, which no op provides")
        times = self.times
        progress = True
        while progress:
            progress = False
            for queue in queues.values():
                while queue:
                    op = queue[0]
                    if any(d not in times for d in op.deps) or any(d not in times for d in op.pre_deps):
                        break
                    self._place(op)
                    queue.popleft()
                    progress = True
        stuck = [queue[0].key for queue in queues.values() if queue]
        if stuck:
            raise ValueError(f"deadlock: workers wait forever at ops {stuck}")

    def _arrival(self, deps: Sequence[Hashable], worker: int) -> float:
        t = 0.0
        for dep in deps:
            done = self.times[dep]
            t = max(t, done.end + (self.hop if done.op.worker != worker else 0.0))
        return t

    def _place(self, op: Op) -> None:
        lane = (op.worker, op.lane)
        main_start = max(
            self.free.get(lane, 0.0) + op.pre,
            self._arrival(op.deps, op.worker),
            self._arrival(op.pre_deps, op.worker) + op.pre,
        )
        end = main_start + op.main
        self.times[op.key] = OpTime(op, main_start - op.pre, main_start, end)
        self.free[lane] = end

    def _check(self, op: Op) -> None:
        if not 0 <= op.worker < self.num_workers:
            raise ValueError(f"op {op.key!r} has worker={op.worker}, outside [0, {self.num_workers})")
        if op.kind not in OP_KINDS:
            raise ValueError(f"op {op.key!r} has kind={op.kind!r}, expected one of {OP_KINDS}")
        for name in ("main", "pre"):
            value = getattr(op, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"op {op.key!r} has {name}={value!r}, must be finite and >= 0")


# --- picture ---

_COLOURS = {
    ("forward", "main"): "#4e79a7",
    ("fused", "pre"): "#8cd17d",
    ("fused", "main"): "#59a14f",
    ("backward", "pre"): "#f28e2b",
    ("backward", "main"): "#e15759",
    ("upload", "main"): "#9c9c9c",
}
_LEGEND = (
    ("forward", "#4e79a7"),
    ("head forward (fused)", "#8cd17d"),
    ("fused", "#59a14f"),
    ("recompute", "#f28e2b"),
    ("backward", "#e15759"),
    ("weight upload", "#9c9c9c"),
)


def render_svg(times: Sequence[OpTime], *, num_workers: int, title: str = "", width: int = 1200) -> str:
    """Draw a timeline: one row per worker, one box per op part, hover text with times.

    Args:
        times: the timed ops (e.g. ``Timeline.times.values()``).
        num_workers: N >= 1 rows.
        title: a line above the picture.
        width: picture width in pixels (>= 200).

    Returns:
        SVG text. Pre-parts (recompute, head forward) are drawn in their own colour; weight uploads as a
        thin bar under the compute row; empty ops are left out.

    Raises:
        ValueError: ``num_workers`` or ``width`` out of range, or an op on a worker outside ``[0, N)``.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers={num_workers!r} must be an integer >= 1")
    if isinstance(width, bool) or not isinstance(width, int) or width < 200:
        raise ValueError(f"width={width!r} must be an integer >= 200")
    left, top, row, bar = 48, 28 if title else 8, 26, 16
    span = max((t.end for t in times), default=0.0) or 1.0
    scale = (width - left - 12) / span
    height = top + row * num_workers + 44
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    if title:
        out.append(f'<text x="{left}" y="18" font-size="13">{_escape(title)}</text>')
    for w in range(num_workers):
        y = top + row * w
        out.append(f'<text x="4" y="{y + bar - 3}">w{w}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{width - left - 12}" height="{bar}" fill="#f3f3f3"/>')
    for t in times:
        op = t.op
        if not 0 <= op.worker < num_workers:
            raise ValueError(f"op {op.key!r} has worker={op.worker}, outside [0, {num_workers})")
        y = top + row * op.worker + (bar + 1 if op.lane == "upload" else 0)
        h = 4 if op.lane == "upload" else bar
        parts = (("pre", t.start, t.main_start), ("main", t.main_start, t.end))
        for part, a, b in parts:
            if b <= a:
                continue
            colour = _COLOURS.get((op.kind, part), "#bab0ac")
            tip = f"w{op.worker} {op.label or op.key} {part}: {a:.2f} to {b:.2f}"
            out.append(
                f'<rect x="{left + a * scale:.2f}" y="{y}" width="{max((b - a) * scale, 0.5):.2f}" '
                f'height="{h}" fill="{colour}" stroke="white" stroke-width="0.4">'
                f"<title>{_escape(tip)}</title></rect>"
            )
    axis = top + row * num_workers + 4
    out.append(f'<line x1="{left}" y1="{axis}" x2="{width - 12}" y2="{axis}" stroke="#444"/>')
    step = _tick(span)
    k = 0
    while k * step <= span * (1 + 1e-9):
        x = left + k * step * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis}" x2="{x:.2f}" y2="{axis + 4}" stroke="#444"/>')
        out.append(f'<text x="{x:.2f}" y="{axis + 15}" text-anchor="middle">{k * step:g}</text>')
        k += 1
    x = left
    for name, colour in _LEGEND:
        out.append(f'<rect x="{x}" y="{axis + 24}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{x + 14}" y="{axis + 33}">{name}</text>')
        x += 14 + 7 * len(name) + 16
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _tick(span: float) -> float:
    """A round tick step giving about eight ticks over ``span``."""
    raw = span / 8
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
