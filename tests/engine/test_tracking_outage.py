"""A tracker that goes down while the run goes on loses no metric point: the pauses between tries
are not cut short by new points, points past the memory bound wait in a spool file, the points
left when the run ends are sent first by a resumed run, and a real MLflow server stopped and
started again mid-run ends with every step once, in order."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from engine.config import TrainConfig
from engine.tracking import Point, RetryPolicy, TrackingOptions
from engine.tracking import start as start_trackers
from engine.tracking.background import Background
from engine.tracking.trackers import saved_id
from tests.engine.mlflow_server import MlflowServer, free_port


class Server:
    """The far end of a tracker's calls: down until ``up`` is set; every try is timed."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.tries: list[tuple[float, bool]] = []  # (when, went through)
        self.batches: list[list[Point]] = []

    def send(self, points: list[Point]) -> None:
        self.tries.append((time.monotonic(), self.up.is_set()))
        if not self.up.is_set():
            raise ConnectionError("connection refused")
        self.batches.append(points)

    @property
    def steps(self) -> list[int]:
        return [p.step for batch in self.batches for p in batch]


def background(
    server: Server, spool: Path, policy: RetryPolicy, warnings: list[str], batch: int = 1
) -> Background:
    return Background(
        "x",
        start=lambda: None,
        send=server.send,
        spool=spool,
        warn=lambda message, data: warnings.append(message),
        policy=policy,
        batch=batch,
    )


def test_a_pause_between_tries_is_not_cut_short_by_new_points(tmp_path: Path) -> None:
    server, warnings = Server(), []
    bg = background(
        server, tmp_path / "x.jsonl", RetryPolicy(first_pause_s=0.2, max_pause_s=0.4, close_s=5), warnings
    )
    step, started = 0, time.monotonic()
    while time.monotonic() - started < 1.5:  # a point every 10 ms while the server is down
        step += 1
        bg.log(Point(step, {"loss/train": 1.0 / step}, step))
        time.sleep(0.01)
    server.up.set()
    closing = time.monotonic()
    assert bg.close()

    failed = [i for i, (_, ok) in enumerate(server.tries) if not ok]
    # each pause runs its course (0.2 s, then 0.4 s): ~5 tries in 1.5 s, not one per new point
    gaps = [server.tries[i + 1][0] - server.tries[i][0] for i in failed if server.tries[i + 1][0] < closing]
    assert 2 <= len(failed) <= 8 and gaps, server.tries
    assert min(gaps) >= 0.18, gaps
    assert server.steps == list(range(1, step + 1))  # every point, once, in order
    assert any("retrying in the background" in m for m in warnings)
    assert any("reachable again" in m for m in warnings)


def test_points_past_the_memory_bound_wait_in_the_spool_file_and_go_in_order(tmp_path: Path) -> None:
    server, warnings = Server(), []
    spool = tmp_path / "tracker-spool" / "x.jsonl"
    policy = RetryPolicy(first_pause_s=0.05, max_pause_s=0.05, queue=5, close_s=10)
    bg = background(server, spool, policy, warnings, batch=3)
    started = time.monotonic()
    for step in range(1, 21):
        bg.log(Point(step, {"loss/train": float(step)}, 1_700_000_000_000 + step))
    assert time.monotonic() - started < 0.5  # the run is not held back
    assert len(bg.spool.memory) == 5  # bounded: the next 15 wait in the file
    assert [json.loads(line)["step"] for line in spool.read_text().splitlines()] == list(range(6, 21))

    server.up.set()
    assert bg.close()
    assert server.steps == list(range(1, 21))  # read back from the file after memory, none twice
    assert all(len(batch) <= 3 for batch in server.batches)
    assert [p.time_ms for batch in server.batches for p in batch] == [
        1_700_000_000_000 + s for s in range(1, 21)
    ]
    assert not spool.exists() and not spool.parent.exists()
    assert any(
        "x: 5 points wait in memory: from step 6 on they wait in tracker-spool/x.jsonl" in m for m in warnings
    )
    assert not any("lost" in m for m in warnings)


def test_points_left_at_the_end_are_kept_and_a_resumed_run_sends_them_first(tmp_path: Path) -> None:
    spool = tmp_path / "tracker-spool" / "x.jsonl"
    down, warnings = Server(), []
    bg = background(down, spool, RetryPolicy(first_pause_s=0.05, close_s=0.3), warnings)
    for step in (1, 2, 3, 4):
        bg.log(Point(step, {"loss/train": float(step)}, 1000 + step))
    assert bg.close() is False
    assert (
        "x: 4 point(s) (steps 1-4) not delivered by the run's end are kept in tracker-spool/x.jsonl"
        in warnings[-1]
    )
    assert [Point.parse(line).step for line in spool.read_text().splitlines()] == [1, 2, 3, 4]

    up, again = Server(), []
    up.up.set()
    resumed = background(up, spool, RetryPolicy(first_pause_s=0.05, close_s=5), again)
    for step in (5, 6):
        resumed.log(Point(step, {"loss/train": float(step)}, 1000 + step))
    assert resumed.close()
    assert up.steps == [1, 2, 3, 4, 5, 6]
    assert [p.time_ms for batch in up.batches for p in batch] == [1001, 1002, 1003, 1004, 1005, 1006]
    assert (
        "x: sends first the 4 point(s) (steps 1-4) an earlier run left in tracker-spool/x.jsonl" in again[0]
    )
    assert not spool.exists()


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("first_pause_s", 0.0, "RetryPolicy.first_pause_s is a number of seconds > 0, not 0.0"),
        ("max_pause_s", float("nan"), "RetryPolicy.max_pause_s is a number of seconds > 0, not nan"),
        ("close_s", -1.0, "RetryPolicy.close_s is a number of seconds >= 0, not -1.0"),
        ("queue", 0, "RetryPolicy.queue holds at least 1 point, not 0"),
    ],
)
def test_a_retry_policy_names_the_field_it_refuses(field: str, value: float, said: str) -> None:
    with pytest.raises(ValueError) as err:
        RetryPolicy(**{field: value})
    assert str(err.value) == said


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-outage"))
    server.start()
    try:
        server.wait()
        yield server
    finally:
        server.stop()


def run_config(uri: str, output_dir: Path) -> TrainConfig:
    tracking = {"mlflow": {"tracking_uri": uri, "experiment": "outage"}}
    return TrainConfig.parse(
        {"data": {"train": "x.jsonl"}, "tracking": tracking, "output_dir": str(output_dir)}
    )


def history(uri: str, run_id: str) -> list[tuple[int, int, float]]:
    """MLflow's ``loss/train`` history of the run: (time, step, value), as stored."""
    from mlflow import MlflowClient

    found = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "loss/train")
    return sorted((m.timestamp, m.step, m.value) for m in found)


@pytest.mark.slow
def test_an_outage_of_the_mlflow_server_loses_no_point(server: MlflowServer, tmp_path: Path) -> None:
    events: list[tuple[str, dict]] = []
    policy = RetryPolicy(first_pause_s=0.5, max_pause_s=2.0, close_s=30)
    trackers = start_trackers(
        run_config(server.url, tmp_path / "run"),
        warn=lambda message, data: events.append((message, data)),
        options=TrackingOptions(name="outage", policy=policy),
    )
    assert trackers is not None
    step, slowest = 0, 0.0

    def log_one() -> None:
        nonlocal step, slowest
        step += 1
        started = time.monotonic()
        trackers.log({"loss/train": 1.0 / step, "progress/step": float(step)}, step)
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.5)

    for _ in range(3):
        log_one()
    deadline = time.monotonic() + 20
    while not (run_id := saved_id(tmp_path / "run", "mlflow_run_id")) or len(history(server.url, run_id)) < 3:
        assert time.monotonic() < deadline, events
        time.sleep(0.2)

    # an outage longer than the old back-off's six tries (~8 s with this policy, ~3 s when new
    # points cut it short): the server stopped, started again on the same port and database
    server.stop()
    down = time.monotonic()
    server.start()
    while not server.up() or time.monotonic() - down < 8:
        assert time.monotonic() - down < 120, server.log()[-3000:]
        log_one()
    for _ in range(2):
        log_one()
    trackers.finish("succeeded")

    got = history(server.url, run_id)
    assert [s for _, s, _ in got] == list(range(1, step + 1)), events  # every step once, in order
    assert [v for _, _, v in got] == pytest.approx([1.0 / s for s in range(1, step + 1)])
    messages = [m for m, _ in events]
    assert any("retrying in the background" in m for m in messages)
    assert any("reachable again" in m for m in messages)
    assert not any("gave up" in m or "lost" in m or "kept in" in m for m in messages), messages
    assert not (tmp_path / "run" / "tracker-spool").exists()
    assert slowest < 0.25  # the run never waited on the tracker
    from mlflow import MlflowClient

    assert MlflowClient(tracking_uri=server.url).get_run(run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_points_a_run_could_not_send_reach_mlflow_with_the_resumed_run_once(
    server: MlflowServer, tmp_path: Path
) -> None:
    folder = tmp_path / "run"
    quick = TrackingOptions(name="resume", policy=RetryPolicy(first_pause_s=0.1, max_pause_s=0.2, close_s=1))

    def run(uri: str, steps: list[int], status: str) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        trackers = start_trackers(
            run_config(uri, folder), warn=lambda m, d: events.append((m, d)), options=quick
        )
        assert trackers is not None
        for s in steps:
            trackers.log({"loss/train": float(s)}, s)
        trackers.finish(status)
        return events

    assert not run(server.url, [1, 2], "failed")
    run_id = saved_id(folder, "mlflow_run_id")
    assert run_id and [s for _, s, _ in history(server.url, run_id)] == [1, 2]

    # the resume finds its tracker down (a port nothing listens on) the whole time
    events = run(f"http://127.0.0.1:{free_port()}", [3, 4], "failed")
    kept = [d for _, d in events if "spooled" in d]
    assert kept == [
        {
            "tracker": "mlflow",
            "level": "warning",
            "spooled": 2,
            "steps": "3-4",
            "first_step": 3,
            "last_step": 4,
        }
    ]
    spool = folder / "tracker-spool" / "mlflow.jsonl"
    # the batch in flight when a run ends goes to the file too, though the server may have got it:
    # here step 2 again, as delivered (its time included)
    stamp, _, value = history(server.url, run_id)[1]
    again = Point(2, {"loss/train": value}, stamp).line()
    spool.write_text(again + spool.read_text())

    events = run(server.url, [5], "succeeded")
    assert "sends first the 3 point(s) (steps 2-4)" in events[0][0]
    got = history(server.url, run_id)
    assert [s for _, s, _ in got] == [1, 2, 3, 4, 5]  # the same run, each step once, in order
    assert [v for _, _, v in got] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert not spool.exists()
    assert saved_id(folder, "mlflow_run_id") == run_id
