"""Server-sent event streams: a job's events (replayable by id), the GPU hosts' telemetry, and the
progress of Hub transfers.

A waiting stream holds no database connection and no thread. One ``Hub`` per app polls for all
of them: one query per interval reads the new events of every job that has a stream open, one
reads the GPU hosts for every GPU stream, one reads every followed transfer, and the streams with
news are woken. A job stream
first replays the job's history with short-lived sessions of its own, then takes the hub's rows.

Streams end when the server is asked to stop (``Hub.stop``; ``lifespan`` chains it to the
server's SIGTERM and SIGINT handlers): uvicorn waits for every open connection before it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session, sessionmaker

from server.deps import IdPath, current_key, found_job
from server.kinds import EventKind
from server.services import gpus, jobs, transfers
from server.tables import JobEvent

POLL_S = 0.5
KEEPALIVE_S = 15.0
PAGE = 500  # events per replay query
BATCH = 2000  # events per query of the hub (it polls again at once when one is full)
JOBS_PER_QUERY = 200  # jobs per query (SQLite limits an expression's depth to 1000)
log = logging.getLogger(__name__)


def frame(*, data: Any, event: str | None = None, ident: int | None = None) -> str:
    lines = []
    if ident is not None:
        lines.append(f"id: {ident}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.append(f"data: {json.dumps(data, default=str)}")
    return "\n".join(lines) + "\n\n"


@dataclass(frozen=True)
class Row:
    """An event as a stream sends it: its id, its frame, the state it moved the job to (a state
    event) and whether that state is final (a resume moves a job out of one again)."""

    id: int
    text: str
    final: str | None
    state: str | None = None

    def settle(self, final: str | None) -> str | None:
        """The job's final state after this row, given the one before it."""
        return final if self.state is None else self.final

    @classmethod
    def of(cls, e: JobEvent) -> Row:
        data = {
            "id": e.id,
            "kind": e.kind,
            "step": e.step,
            "message": e.message,
            "data": e.data,
            "created_at": e.created_at.isoformat(),
        }
        to = (e.data or {}).get("to") if e.kind == EventKind.STATE else None
        final = to if to in jobs.TERMINAL else None
        return cls(
            e.id, frame(data=data, event=e.kind, ident=e.id), final, to if isinstance(to, str) else None
        )


@dataclass(eq=False)
class Follower:
    """One job stream as the hub sees it: the last event id handed to it, and the rows since."""

    job_id: str
    last: int
    live: bool = False  # False while the stream replays with its own sessions
    rows: list[Row] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class TransferFollower:
    """One transfer stream: the transfer as the last poll read it (``seq``: its progress counter;
    ``payload`` None and ``gone`` once the row is deleted)."""

    transfer_id: str
    seq: int = -1
    payload: dict[str, Any] | None = None
    gone: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Hub:
    """The one poller behind every open stream of an app (``app.state.streams``)."""

    def __init__(self, sessions: sessionmaker[Session], *, stale_after: float, gpu_every: float) -> None:
        self.sessions = sessions
        self.stale_after, self.gpu_every = stale_after, gpu_every
        self.stopping = False
        self.snapshot: str | None = None  # the GPU hosts as JSON, as the last poll read them
        self._snapshot_at = float("-inf")
        self._followers: dict[str, set[Follower]] = {}
        self._watchers: set[asyncio.Event] = set()
        self._transfers: dict[str, set[TransferFollower]] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick = asyncio.Event()

    def stop(self) -> None:
        """End every stream (within ``POLL_S``). Only sets a flag: safe in a signal handler."""
        self.stopping = True

    # -- subscriptions ---------------------------------------------------------------------------
    def follow(self, job_id: str, after: int) -> Follower:
        self._start()
        follower = Follower(job_id, after)
        self._followers.setdefault(job_id, set()).add(follower)
        return follower

    def unfollow(self, follower: Follower) -> None:
        group = self._followers.get(follower.job_id, set())
        group.discard(follower)
        if not group:
            self._followers.pop(follower.job_id, None)

    def watch(self) -> asyncio.Event:
        """Subscribe to the GPU hosts: the event is set each time ``snapshot`` changes."""
        self._start()
        woken = asyncio.Event()
        self._watchers.add(woken)
        if self._loop is not None and self._loop.time() - self._snapshot_at > self.gpu_every:
            self.snapshot = None  # too old: the next poll, at once, reads a fresh one
            self._kick.set()
        return woken

    def unwatch(self, woken: asyncio.Event) -> None:
        self._watchers.discard(woken)

    def follow_transfer(self, transfer_id: str) -> TransferFollower:
        """Subscribe to a transfer: its follower is woken each time its progress counter moves
        (the first poll, at once, reads it)."""
        self._start()
        follower = TransferFollower(transfer_id)
        self._transfers.setdefault(transfer_id, set()).add(follower)
        self._kick.set()
        return follower

    def unfollow_transfer(self, follower: TransferFollower) -> None:
        group = self._transfers.get(follower.transfer_id, set())
        group.discard(follower)
        if not group:
            self._transfers.pop(follower.transfer_id, None)

    def replay_page(self, *, job_id: str, after: int) -> tuple[list[Row], str | None]:
        """Up to ``PAGE`` events of a job after ``after``, with a session of its own (in a thread),
        and the job's status read just before them (None: no such job)."""
        with self.sessions() as session:
            status = jobs.status_of(session, job_id=job_id)  # first: a final one has all its events
            page = jobs.events(session, job_id=job_id, after=after, limit=PAGE)
            return [Row.of(e) for e in page], status

    # -- the poller ------------------------------------------------------------------------------
    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (a test client's): the old loop's streams are gone
            self._followers, self._watchers, self._transfers, self._task = {}, set(), {}, None
            self._loop, self._kick = loop, asyncio.Event()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="roundhouse-streams")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_gpu = 0.0
        while (self._followers or self._watchers or self._transfers) and not self.stopping:
            full = False
            try:
                full = await self._poll_jobs()
                if self._transfers:
                    await self._poll_transfers()
                if self._watchers and loop.time() >= next_gpu:
                    next_gpu = loop.time() + self.gpu_every
                    await self._poll_gpus()
            except Exception:  # the database is away: the streams wait, the next tick tries again
                log.exception("event streams: polling the database failed")
            if not full:
                self._kick.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_S):
                        await self._kick.wait()
        for group in self._followers.values():  # stopping: every stream sees it and ends
            for follower in group:
                follower.wake.set()
        for woken in self._watchers:
            woken.set()
        for followers in self._transfers.values():
            for transfer in followers:
                transfer.wake.set()

    async def _poll_jobs(self) -> bool:
        """Hand each live follower the rows after its last; True when the poll was full."""
        after = {}
        for job_id, group in self._followers.items():
            lasts = [f.last for f in group if f.live]
            if lasts:
                after[job_id] = min(lasts)
        if not after:
            return False
        by_job, full = await asyncio.to_thread(self._read_events, after)
        for job_id, since in after.items():
            for follower in self._followers.get(job_id, ()):
                # the poll read every row after ``since``; a follower further behind went live
                # during the poll, and the next one reads from its last
                if follower.live and follower.last >= since:
                    news = [r for r in by_job.get(job_id, ()) if r.id > follower.last]
                    if news:
                        follower.rows += news
                        follower.last = news[-1].id
                        follower.wake.set()
        return full

    def _read_events(self, after: dict[str, int]) -> tuple[dict[str, list[Row]], bool]:
        """Each job's new rows, and whether a query was full (more rows wait)."""
        by_job: dict[str, list[Row]] = {}
        full = False
        items = list(after.items())
        with self.sessions() as session:
            for i in range(0, len(items), JOBS_PER_QUERY):
                chunk = dict(items[i : i + JOBS_PER_QUERY])
                events = jobs.events_of_jobs(session, after=chunk, limit=BATCH)
                for e in events:
                    by_job.setdefault(e.job_id, []).append(Row.of(e))
                full = full or len(events) == BATCH
        return by_job, full

    async def _poll_transfers(self) -> None:
        ids = list(self._transfers)
        found = await asyncio.to_thread(self._read_transfers, ids)
        for transfer_id in ids:
            for follower in self._transfers.get(transfer_id, ()):
                if transfer_id not in found:
                    follower.gone = True
                    follower.wake.set()
                    continue
                seq, payload = found[transfer_id]
                if seq != follower.seq:
                    follower.seq, follower.payload = seq, payload
                    follower.wake.set()

    def _read_transfers(self, ids: list[str]) -> dict[str, tuple[int, dict[str, Any]]]:
        """Each transfer's progress counter and its payload (as ``GET /api/transfers/{id}``)."""
        from server.hf_hub.runner import transfer_payload

        with self.sessions() as session:
            rows = transfers.get_many(session, transfer_ids=ids)
            return {
                r.id: (r.progress_seq, json.loads(json.dumps(transfer_payload(r), default=str))) for r in rows
            }

    async def _poll_gpus(self) -> None:
        snapshot = await asyncio.to_thread(self._read_hosts)
        self._snapshot_at = asyncio.get_running_loop().time()
        if snapshot != self.snapshot:
            self.snapshot = snapshot
            for woken in self._watchers:
                woken.set()

    def _read_hosts(self) -> str:
        with self.sessions() as session:
            hosts = gpus.hosts(session, stale_after=self.stale_after)
        return json.dumps(hosts, default=str, sort_keys=True)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The app's lifespan: its hub runs, and a SIGTERM or SIGINT to the server ends the streams.

    uvicorn (one process or several) handles those signals itself and then waits for every open
    connection, streams included, before the app shuts down; so, in the main thread, its handlers
    are chained with the hub's ``stop`` for the app's life."""
    hub: Hub = app.state.streams
    hub.stopping = False
    restore = _chain_signals(hub.stop)
    try:
        yield
    finally:
        restore()
        hub.stop()


def _chain_signals(stop: Callable[[], None]) -> Callable[[], None]:
    """Call ``stop`` before the current SIGTERM and SIGINT handlers; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    installed = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if callable(handler):

            def chained(signum: int, frame: Any, handler: Callable[..., Any] = handler) -> None:
                stop()
                handler(signum, frame)

            signal.signal(sig, chained)
            installed[sig] = (chained, handler)

    def restore() -> None:
        for sig, (chained, handler) in installed.items():
            if signal.getsignal(sig) is chained:
                signal.signal(sig, handler)

    return restore


# -- the routes' side --------------------------------------------------------------------------------
def stream_key(request: Request) -> None:
    """``current_key`` for a stream route, with a session closed before the stream starts (the
    routers' ``SessionDep`` would live, connection and all, as long as the stream)."""
    with request.app.state.sessions() as session:
        current_key(request, session)


def stream_job(request: Request, job_id: IdPath) -> str:
    """``current_key`` and ``JobDep`` for a job's stream, with a short-lived session: the job's id."""
    with request.app.state.sessions() as session:
        current_key(request, session)
        return found_job(session, job_id).id


async def job_stream(hub: Hub, *, job_id: str, after: int) -> AsyncIterator[str]:
    """Every event after ``after``, then new ones as they are written; ends after a final state.

    Each event is sent under its kind (``event: metrics``, ``event: telemetry``...: ``EventKind``)."""
    yield "retry: 2000\n\n"
    follower = hub.follow(job_id, after)
    try:
        final = None
        while True:  # the history, with sessions of its own
            rows, status = await run_in_threadpool(hub.replay_page, job_id=job_id, after=follower.last)
            for row in rows:
                follower.last, final = row.id, row.settle(final)
                yield row.text
            if len(rows) < PAGE or hub.stopping:
                break
        if final or status is None or status in jobs.TERMINAL:
            yield frame(data={"status": final or status}, event="end")
            return
        follower.live = True
        while not hub.stopping:  # then what the hub hands over
            follower.wake.clear()
            rows, follower.rows = follower.rows, []
            for row in rows:
                yield row.text
                final = row.settle(final)
            if final:
                yield frame(data={"status": final}, event="end")
                return
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    await follower.wake.wait()
            except TimeoutError:
                yield ": keep-alive\n\n"
    finally:
        hub.unfollow(follower)


async def gpu_stream(hub: Hub) -> AsyncIterator[str]:
    """A snapshot of every worker host's devices, each time the worker samples them."""
    yield "retry: 2000\n\n"
    woken = hub.watch()
    last = None
    try:
        while not hub.stopping:
            woken.clear()
            if hub.snapshot is not None and hub.snapshot != last:
                last = hub.snapshot
                yield f"event: gpus\ndata: {last}\n\n"
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    await woken.wait()
            except TimeoutError:
                yield ": keep-alive\n\n"
    finally:
        hub.unwatch(woken)


async def transfer_stream(hub: Hub, *, transfer_id: str) -> AsyncIterator[str]:
    """``progress`` events (the transfer as ``GET /api/transfers/{id}`` shows it) each time it
    changes, then ``end`` once it is finished."""
    yield "retry: 2000\n\n"
    follower = hub.follow_transfer(transfer_id)
    last = -1
    try:
        while not hub.stopping and not follower.gone:
            follower.wake.clear()
            payload = follower.payload
            if payload is not None and follower.seq != last:
                last = follower.seq
                yield frame(data=payload, event="progress", ident=last)
                if payload["status"] in transfers.TERMINAL:
                    yield frame(data={"status": payload["status"]}, event="end")
                    return
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    await follower.wake.wait()
            except TimeoutError:
                yield ": keep-alive\n\n"
    finally:
        hub.unfollow_transfer(follower)
