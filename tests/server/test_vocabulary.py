"""One vocabulary: the engine's event kinds are the service's, and a failed job says where the
engine failed."""

from __future__ import annotations

from engine.errors import EngineError
from engine.kinds import EngineEvent
from server.kinds import EventKind
from server.worker.trainer import failure_text


def test_every_engine_event_kind_is_a_service_event_kind() -> None:
    for kind in EngineEvent:
        assert EventKind(kind.value) == kind, kind


def test_a_failed_jobs_error_names_the_stage_worker_and_step() -> None:
    exc = EngineError("stage B3 (layers 0-1) on worker 1 (cuda:1), iteration 119: RuntimeError: boom")
    exc.stage, exc.stage_kind, exc.worker, exc.iteration, exc.step = "B3", "backward", "cuda:1", 119, 120
    text = failure_text(exc)
    assert text.startswith("failed in backward stage B3 on cuda:1 at step 120: EngineError: stage B3"), text
    assert failure_text(ValueError("bad value")) == "ValueError: bad value"
    optimizer = EngineError("optimizer worker: RuntimeError: x", stage="optimizer", step=4)
    assert failure_text(optimizer).startswith("failed in optimizer at step 4: "), failure_text(optimizer)
