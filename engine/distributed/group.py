"""The boxes of one job, joined: a rendezvous store, heartbeats, and two gloo groups.

Rank 0 runs a TCP store at ``Boxes.address``; every box writes its host name there and then
beats (a counter it raises twice a second, from a thread of its own). Two gloo process groups
carry the traffic: ``exchange`` the optimizer thread's (each step's gradients and statistics),
``control`` the training loop's (the resumed state, each step's stop vote, a count to sum), so
the two threads never interleave collectives on one group.

A gloo collective cannot tell a box that is busy (writing a checkpoint for minutes) from one
that is gone, and cannot be interrupted once it waits. So no box enters a collective before
every box has arrived at it: each raises the collective's arrival counter in the store and waits
for ``world_size`` arrivals, watching the others' heartbeats meanwhile. A box whose heartbeat has
not moved for ``timeout_s``, one that left with an error (its ``left/<rank>`` key names why), or a
store that stops answering (rank 0 gone) ends the wait with ``BoxLost`` naming that box. Once
every box has arrived the collective itself only moves bytes, under gloo's ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from engine.distributed.boxes import Boxes, BoxLost
from engine.scheduling.exchange import GBIT, ring_bytes

T = TypeVar("T")

BEAT_S = 0.5  # a box raises its heartbeat counter this often
PROBE_BYTES = 8 << 20  # the link probe's all-reduce at the start
PROBE_REPEATS = 3
SETTLE_S = 4 * BEAT_S  # after a failed exchange: a heartbeat still this long names the lost box
CHUNK_BYTES = 256 << 20  # a broadcast tensor travels in chunks of at most this
BUCKET_BYTES = 32 << 20  # small gradients travel together up to this (one all-reduce)


class Group:
    """The joined boxes of one job (``join`` makes one).

    Attributes:
        boxes: this process's ``Boxes``.
        hosts: every box's host name, by rank.
        link_gbps: the all-reduce rate measured at the start (Gbit/s each box sent).
    """

    def __init__(self, boxes: Boxes, store: Any, *, exchange: Any, control: Any) -> None:
        self.boxes = boxes
        self.rank = boxes.rank
        self.world_size = boxes.world_size
        self._store = store
        self._exchange = exchange
        self._control = control
        self._arrivals: dict[str, int] = {}
        self._clients: dict[int, Any] = {}  # a store connection per thread
        self._lock = threading.Lock()
        self.hosts: list[str] = [boxes.host] * boxes.world_size
        self.link_gbps = 0.0
        self._closed = threading.Event()
        self._beater = threading.Thread(target=self._beat, name="boxes-heartbeat", daemon=True)
        self._beater.start()

    @property
    def writer(self) -> bool:
        """This box writes the checkpoints and reports the progress (rank 0)."""
        return self.rank == 0

    # -- the store -------------------------------------------------------------------------------
    def _client(self) -> Any:
        """This thread's connection to the store (a TCP store client is used by one thread)."""
        ident = threading.get_ident()
        with self._lock:
            client = self._clients.get(ident)
            if client is None:
                client = self._clients[ident] = _connect(self.boxes, self.boxes.timeout_s)
        return client

    def _beat(self) -> None:
        key = f"beat/{self.rank}"
        try:
            client = _connect(self.boxes, self.boxes.timeout_s)
            while not self._closed.wait(BEAT_S):
                client.add(key, 1)
        except Exception:  # the store is gone: the waits of this box find it out and name it
            return

    def _lost(self, rank: int, why: str) -> BoxLost:
        host = self.hosts[rank]
        return BoxLost(f"box {host} (rank {rank}) {why}", host=host, rank=rank)

    def _store_lost(self, exc: BaseException) -> BoxLost:
        host = self.hosts[0]
        return BoxLost(
            f"box {host} (rank 0, the rendezvous at {self.boxes.address}) stopped answering: {_said(exc)}",
            host=host,
            rank=0,
        )

    def arrive(self, name: str, *, timeout_s: float | None = None) -> None:
        """Wait until every box has reached its next ``name`` collective, watching their
        heartbeats (``timeout_s``: a heartbeat that long still is a lost box)."""
        limit = self.boxes.timeout_s if timeout_s is None else timeout_s
        n = self._arrivals.get(name, 0) + 1
        self._arrivals[name] = n
        key = f"{name}/{n}"
        client = self._client()
        try:
            count = int(client.add(key, 1))
            if self.rank == 0 and n > 2:  # every box has passed the barrier before the last one
                client.delete_key(f"{name}/{n - 2}")
            seen: dict[int, tuple[int, float]] = {}
            delay, checked = 0.0005, 0.0
            while count < self.world_size:
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
                count = int(client.add(key, 0))
                now = time.monotonic()
                if now - checked >= BEAT_S:
                    checked = now
                    self._check_peers(client, seen, now, limit)
        except BoxLost:
            raise
        except Exception as exc:
            raise self._store_lost(exc) from exc

    def _check_peers(self, client: Any, seen: dict[int, tuple[int, float]], now: float, limit: float) -> None:
        for r in range(self.world_size):
            if r == self.rank:
                continue
            if client.check([f"left/{r}"]):
                why = client.get(f"left/{r}").decode("utf-8", "replace")
                raise self._lost(r, f"stopped: {why}")
            beats = int(client.add(f"beat/{r}", 0))
            last = seen.get(r)
            if last is None or beats != last[0]:
                seen[r] = (beats, now)
            elif now - last[1] > limit:
                raise self._lost(r, f"stopped answering: no heartbeat for {limit:g} s")

    # -- collectives -----------------------------------------------------------------------------
    def _collective(self, name: str, group: Any, run: Callable[[], T]) -> T:
        self.arrive(name)
        try:
            return run()
        except BoxLost:
            raise
        except Exception as exc:  # a box went away in the middle: find which by its heartbeat
            try:
                self._identify(SETTLE_S)
            except BoxLost as lost:
                raise lost from exc
            except Exception as store_exc:
                raise self._store_lost(store_exc) from exc
            raise BoxLost(f"the exchange between the boxes failed: {_said(exc)}") from exc

    def _identify(self, window_s: float) -> None:
        """After a failed collective: raise ``BoxLost`` for a box that left or whose heartbeat
        does not move for ``window_s`` (a live box beats every ``BEAT_S``)."""
        client = self._client()
        seen: dict[int, tuple[int, float]] = {}
        deadline = time.monotonic() + window_s + BEAT_S
        while time.monotonic() < deadline:
            self._check_peers(client, seen, time.monotonic(), window_s)
            time.sleep(BEAT_S / 5)

    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum ``tensors`` over the boxes in place (the optimizer thread's gradient exchange).

        Each all-reduce pays the ring's latency ``2 (k - 1)`` times, so small tensors travel
        together: consecutive ones are packed into buckets of up to ``BUCKET_BYTES`` (a bucket's
        copy is the only extra memory), a larger tensor goes alone, in place."""

        def run() -> None:
            for bucket in _buckets(tensors):
                if len(bucket) == 1:
                    dist.all_reduce(bucket[0], op=dist.ReduceOp.SUM, group=self._exchange)
                    continue
                flat = torch.cat([t.reshape(-1) for t in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._exchange)
                offset = 0
                for t in bucket:
                    n = t.numel()
                    t.copy_(flat[offset : offset + n].view_as(t))
                    offset += n

        self._collective("exchange", self._exchange, run)

    def sum_values(self, values: Sequence[float], *, name: str = "exchange") -> list[float]:
        """``values`` summed over the boxes, in float64 (on the exchange group: the optimizer
        thread; ``name="control"``: the training loop's)."""
        group = self._exchange if name == "exchange" else self._control
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)

        def run() -> None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)

        self._collective(name, group, run)
        return [float(v) for v in t.tolist()]

    def any(self, flag: bool) -> bool:
        """Whether any box votes ``flag`` (the training loop's stop vote at a step boundary)."""
        return self.sum_values([1.0 if flag else 0.0], name="control")[0] > 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (plain values, tensors, in dicts, lists and tuples), on every box:
        the resumed state. Its shape goes pickled, its tensors one by one as bytes, in chunks of
        at most ``CHUNK_BYTES``, so nothing holds a pickled copy of a large state."""
        tensors: list[torch.Tensor] = []
        payload = [_strip(value, tensors) if self.rank == 0 else None]

        def run() -> None:
            dist.broadcast_object_list(payload, src=0, group=self._control)
            if self.rank != 0:  # room for rank 0's tensors, in the order it listed them
                slots: list[_Slot] = []
                _fill(payload[0], slots, None)
                tensors.extend(torch.empty(slot.shape, dtype=slot.dtype) for slot in slots)
            for t in tensors:
                if not t.numel():
                    continue
                flat = t.reshape(-1).view(torch.uint8)
                for start in range(0, int(flat.numel()), CHUNK_BYTES):
                    dist.broadcast(flat[start : start + CHUNK_BYTES], src=0, group=self._control)

        self._collective("control", self._control, run)
        return value if self.rank == 0 else _fill(payload[0], [], tensors)

    def gather(self, value: Any) -> list[Any]:
        """Every box's ``value``, by rank (small, picklable)."""
        out: list[Any] = [None] * self.world_size

        def run() -> None:
            dist.all_gather_object(out, value, group=self._control)

        self._collective("control", self._control, run)
        return out

    def probe(self) -> float:
        """Measure the exchange: the median of a few all-reduces of ``PROBE_BYTES``, as the
        Gbit/s each box sent (a ring sends ``2 (k - 1) / k`` times the bytes)."""
        buffer = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
        times = []
        for _ in range(PROBE_REPEATS):
            t0 = time.perf_counter()
            self.sum_([buffer])
            times.append(time.perf_counter() - t0)
        seconds = sorted(times)[len(times) // 2]
        self.link_gbps = ring_bytes(PROBE_BYTES, self.world_size) / max(seconds, 1e-9) / GBIT
        return self.link_gbps

    # -- the end ---------------------------------------------------------------------------------
    def leave(self, why: str) -> None:
        """Tell the others this box stops (they raise ``BoxLost`` with ``why`` at once)."""
        with contextlib.suppress(Exception):  # the store is gone: they find out by themselves
            self._client().set(f"left/{self.rank}", why[:2000])

    def close(self) -> None:
        """Stop the heartbeat and leave the process groups. Safe to call twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._beater.join(timeout=2 * BEAT_S)
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        self._clients.clear()


@dataclass(frozen=True)
class _Slot:
    """Where a tensor was in a broadcast value: its place, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a ``_Slot`` (the tensors appended, contiguous)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().contiguous())
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_strip(v, tensors) for v in value)
    return value


def _fill(skeleton: Any, slots: list[_Slot], tensors: list[torch.Tensor] | None) -> Any:
    """``skeleton``'s slots listed in order (``tensors`` None), or replaced by ``tensors``."""
    if isinstance(skeleton, _Slot):
        slots.append(skeleton)
        return skeleton if tensors is None else tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill(v, slots, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fill(v, slots, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_fill(v, slots, tensors) for v in skeleton)
    return skeleton


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in order, consecutive ones of one dtype grouped up to ``BUCKET_BYTES``."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if last is not None and last[0].dtype == t.dtype and size + nbytes <= BUCKET_BYTES:
            last.append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out


def _said(exc: BaseException) -> str:
    """An exception's type and the first line of its message (torch's network errors append a
    C++ stack trace)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _connect(boxes: Boxes, timeout_s: float) -> Any:
    host, port = boxes.endpoint()
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join(boxes: Boxes) -> Group:
    """Join the job's other boxes: rank 0 opens the rendezvous store, every box writes its name,
    the gloo groups are made and the link is measured.

    Raises:
        BoxLost: not every box joined within ``boxes.join_timeout_s`` (the message names the
            ranks that did not), or the rendezvous at ``boxes.address`` could not be reached.
        ConfigError: a bad address.
    """
    host, port = boxes.endpoint()
    if boxes.interface:
        os.environ["GLOO_SOCKET_IFNAME"] = boxes.interface
    wait = timedelta(seconds=boxes.join_timeout_s)
    try:
        store = dist.TCPStore(host, port, is_master=boxes.rank == 0, timeout=wait, wait_for_workers=False)
    except Exception as exc:
        where = "open" if boxes.rank == 0 else "reach"
        raise BoxLost(
            f"could not {where} the rendezvous at {boxes.address}: {_said(exc)}",
            rank=0,
        ) from exc
    store.set(f"host/{boxes.rank}", boxes.host)
    keys = [f"host/{r}" for r in range(boxes.world_size)]
    deadline = time.monotonic() + boxes.join_timeout_s
    while True:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise BoxLost(
                f"boxes of rank {', '.join(map(str, missing))} did not join the job at {boxes.address} "
                f"within {boxes.join_timeout_s:g} s",
                rank=missing[0],
            )
        time.sleep(0.05)
    hosts = [store.get(k).decode("utf-8", "replace") for k in keys]
    collective = timedelta(seconds=boxes.timeout_s)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("exchange", store),
            rank=boxes.rank,
            world_size=boxes.world_size,
            timeout=collective,
        )
        exchange = dist.group.WORLD
        control = dist.new_group(backend="gloo", timeout=collective)
    except Exception as exc:
        raise BoxLost(f"the boxes could not connect to each other: {_said(exc)}") from exc
    group = Group(boxes, store, exchange=exchange, control=control)
    group.hosts = hosts
    try:
        group.probe()
    except BaseException:
        group.close()
        raise
    return group
