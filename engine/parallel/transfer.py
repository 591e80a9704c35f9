"""Moving tensors between host memory and one worker device.

On a CUDA device a worker owns a compute stream and four copy streams (activations up,
activations down, parameters up, gradients down); host buffers are pinned and CUDA events order
the streams and the threads. On the CPU the same calls run synchronously, so the executor has a
single code path. ``plan_windows`` (pure) cuts a stage's parameters into micro-batch windows;
``resolve_device`` turns a worker name into its device. Every copy is logged with its bytes and
its start and end (``DeviceLink.copies``, CUDA timing events on its copy stream, or clock
readings around a CPU copy) for the transfer metrics (``engine.parallel.activity``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import ConfigError
from engine.parallel.activity import D2H, H2D


def resolve_device(name: str) -> torch.device:
    """The device of a worker named ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ConfigError: (``EngineConfig.devices``) CUDA asked for but absent, or no such GPU.
    """
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(
            "EngineConfig.devices",
            f"EngineConfig.devices: {name!r} asked for, but CUDA is not available here",
            value=name,
        )
    dev = torch.device("cuda:0" if name == "cuda" else name)
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(
            "EngineConfig.devices",
            f"EngineConfig.devices: {name!r} does not exist ({torch.cuda.device_count()} GPUs)",
            value=name,
        )
    return dev


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened tensor ``key``."""

    key: Any
    start: int
    stop: int


def plan_windows(sizes: Sequence[tuple[Any, int]], num_windows: int) -> list[list[Piece]]:
    """Cut tensors into ``num_windows`` groups of near-equal size, longest first (LPT).

    Tensors larger than one window's share are split into pieces of about that share first,
    so a huge tensor (an LM head) does not land whole in one window.

    Args:
        sizes: ``(key, number of elements)`` per tensor, in a fixed order.
        num_windows: how many windows (micro-batches) the upload is spread over.

    Returns:
        One list of pieces per window; together they cover every element exactly once.

    Raises:
        ValueError: ``num_windows`` < 1 or a negative size.
    """
    if num_windows < 1:
        raise ValueError(f"num_windows must be >= 1, got {num_windows}")
    total = 0
    for key, n in sizes:
        if n < 0:
            raise ValueError(f"tensor {key!r} has a negative size {n}")
        total += n
    share = max(1, -(-total // num_windows))
    pieces: list[Piece] = []
    for key, n in sizes:
        if n == 0:
            continue
        parts = -(-n // share)
        bounds = [n * i // parts for i in range(parts + 1)]
        pieces.extend(Piece(key, a, b) for a, b in itertools.pairwise(bounds) if b > a)
    order = sorted(range(len(pieces)), key=lambda i: (-(pieces[i].stop - pieces[i].start), i))
    windows: list[list[Piece]] = [[] for _ in range(num_windows)]
    loads = [0] * num_windows
    for i in order:
        w = min(range(num_windows), key=lambda j: (loads[j], j))
        windows[w].append(pieces[i])
        loads[w] += pieces[i].stop - pieces[i].start
    return windows


class DeviceLink:
    """Streams and copies of one worker device (``cpu`` or ``cuda:i``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.compute: Any = None
        self.act_up: Any = None
        self.act_down: Any = None
        self.param_up: Any = None
        self.grad_down: Any = None
        if self.is_cuda:
            self.compute = torch.cuda.Stream(device)
            self.act_up = torch.cuda.Stream(device)
            self.act_down = torch.cuda.Stream(device)
            self.param_up = torch.cuda.Stream(device)
            self.grad_down = torch.cuda.Stream(device)
        # (H2D | D2H, bytes, start, end) of every copy since the owner last took them
        self.copies: list[tuple[str, int, Any, Any]] = []

    def take_copies(self) -> list[tuple[str, int, Any, Any]]:
        """The copies logged since the last call (the worker's thread: one stage's)."""
        copies, self.copies = self.copies, []
        return copies

    @contextlib.contextmanager
    def on(self, stream: Any) -> Iterator[None]:
        """Run the enclosed work on ``stream`` (no-op on the CPU)."""
        if stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield

    def record(self, stream: Any, *, timing: bool = False) -> Any:
        """An event marking the work queued on ``stream`` so far (None on the CPU)."""
        if stream is None:
            return None
        # blocking: a host thread waiting on it sleeps instead of spinning a core the CPU
        # optimizer needs
        event = torch.cuda.Event(enable_timing=timing, blocking=True)
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event`` without blocking the host."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def host_wait(event: Any) -> None:
        """Block the calling thread until ``event`` completed."""
        if event is not None:
            event.synchronize()

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """Copy an activation (or micro-batch input) to the device on the activation-up stream.

        The compute stream is made to wait for the copy. On the CPU the host tensor is used as
        it is (stage inputs are never written in place).
        """
        if not self.is_cuda:
            return host.detach()
        with self.on(self.act_up):
            start = self.record(self.act_up, timing=True)
            dev = host.to(self.device, non_blocking=True)
            self.copies.append((H2D, _nbytes(host), start, self.record(self.act_up, timing=True)))
        self.compute.wait_stream(self.act_up)
        dev.record_stream(self.compute)
        return dev

    def download(
        self, dev: torch.Tensor, stream: Any = None, *, into: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]:
        """Copy a device tensor to host memory after the compute queued so far.

        Args:
            into: a pinned host buffer of ``dev``'s size and dtype to copy into (default: a new
                one).

        Returns the host tensor and an event the consumer must wait for (None on the CPU).
        """
        if not self.is_cuda:
            return dev.detach(), None
        stream = stream or self.act_down
        stream.wait_stream(self.compute)
        with self.on(stream):
            host = (
                torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
                if into is None
                else into.view(dev.shape)
            )
            start = self.record(stream, timing=True)
            host.copy_(dev, non_blocking=True)
        dev.record_stream(stream)
        end = self.record(stream, timing=True)
        self.copies.append((D2H, _nbytes(dev), start, end))
        return host, end

    def empty_like(self, host: torch.Tensor) -> torch.Tensor:
        """An uninitialised device buffer shaped like ``host``."""
        if self.is_cuda:
            with torch.cuda.device(self.device):
                return torch.empty(host.shape, dtype=host.dtype, device=self.device)
        return torch.empty_like(host)

    def copy_pieces(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor, int, int]], after: Any) -> Any:
        """Copy ``host.view(-1)[a:b]`` into ``dev.view(-1)[a:b]`` on the parameter stream.

        The copies queue behind ``after`` (the window's activation copy), so weight traffic
        never delays the activation the compute is waiting for. Returns the completion event.
        """
        if self.is_cuda:
            self.wait(self.param_up, after)
        if not pieces:
            return self.record(self.param_up)
        start = self._now(self.param_up)
        nbytes = 0
        with self.on(self.param_up):
            for host, dev, a, b in pieces:
                dev.view(-1)[a:b].copy_(host.view(-1)[a:b], non_blocking=self.is_cuda)
                nbytes += (b - a) * host.element_size()
        end = self._now(self.param_up)
        self.copies.append((H2D, nbytes, start, end))
        return end if self.is_cuda else None

    def _now(self, stream: Any) -> Any:
        """A point in time on ``stream``: a timing event on CUDA, a clock reading on the CPU."""
        return self.record(stream, timing=True) if self.is_cuda else time.perf_counter()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
