"""The words the worker, the API and the UI share: job statuses, event kinds, evaluation statuses.

Tables hold them as plain strings; code compares against these enums. The event kinds the engine
reports through its sink are the engine's own (``engine.kinds.EngineEvent``). The UI's copy is
``web/js/kinds.js`` (``tests/web/test_kinds.py`` checks that the two agree).
"""

from __future__ import annotations

from enum import StrEnum

from engine import EngineEvent


class JobStatus(StrEnum):
    """Where a job is in its life (the transitions are ``server.services.jobs.TRANSITIONS``)."""

    VALIDATING = "validating"
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    PAUSING = "pausing"  # a worker holds it and stops it at the next step boundary, with a checkpoint
    PAUSED = "paused"  # stopped with a checkpoint at the step it reached; no worker holds it until resumed
    INTERRUPTED = "interrupted"  # its worker vanished: requeued, it resumes from its last checkpoint
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class EventKind(StrEnum):
    """What a job event row records (and the SSE event name it is streamed under)."""

    STATE = "state"  # a status transition: data {"from", "to"}
    METRICS = "metrics"  # training metrics of one step (the engine sink's ``log``)
    TELEMETRY = "telemetry"  # the worker host's GPU and CPU sample (gpu/*, host/*), no step
    LOG = "log"  # a line for the user (e.g. a cancel relayed)
    # the engine's (its sink's ``event``)
    CHECKPOINT = EngineEvent.CHECKPOINT.value  # the run saved a checkpoint: data {"step", "path"}
    RESUME = EngineEvent.RESUME.value  # the run resumed from a checkpoint: data {"step"}
    PARTITION = EngineEvent.PARTITION.value  # the pipeline's layer partition, from parameter sizes
    REPARTITION = EngineEvent.REPARTITION.value  # the partition recomputed from measured layer times
    REFERENCE = EngineEvent.REFERENCE.value  # a reference pass (DPO's log-probabilities), computed or read
    TRACKER = EngineEvent.TRACKER.value  # a tracker (MLflow, W&B) failing or back: data {"tracker"}
    # a step not applied (a non-finite loss or gradient norm): data {"step", "what", "in_a_row"}
    SKIPPED = EngineEvent.SKIPPED.value
    # a job on several boxes joined: data {"hosts": names by rank, "link_gbps", "gradient_bytes"}
    BOXES = EngineEvent.BOXES.value
    # a GRPO step's sampled completions, graded (``engine.methods.grpo.train.SAMPLES_EVENT``): data
    # {"step", "samples": [{"prompt", "completion", "reward", "error"}]}
    SAMPLES = "samples"
    # where a GRPO run samples its completions, and why (``engine.methods.grpo.train.ROLLOUTS_EVENT``):
    # data {"device"}
    ROLLOUTS = "rollouts"


class EvaluationStatus(StrEnum):
    """Where a checkpoint's evaluation is (a worker runs it)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


# the kinds whose data are metric values: GET /api/jobs/{id}/metrics reads them, the UI charts them
METRIC_KINDS = (EventKind.METRICS, EventKind.TELEMETRY)
