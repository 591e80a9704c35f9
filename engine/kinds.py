"""The engine's vocabulary: the kinds of events it reports, how a run ends, the kinds of layers
and stages.

Each is a ``StrEnum``: its members are the strings themselves, so sinks, JSON and the service's
tables carry plain strings, and code compares against the members. The service's
``server.kinds.EventKind`` takes the engine's event kinds from here.
"""

from __future__ import annotations

from enum import StrEnum

from engine.scheduling.partition import StageKind

__all__ = ["EngineEvent", "LayerKind", "RunStatus", "StageKind"]


class EngineEvent(StrEnum):
    """What a sink's ``event(kind, message, data)`` reports."""

    # the run saved a checkpoint (told by ``Sink.checkpoint_saved``; the service's event rows:
    # data {"step", "path", "kind", "bytes"}, rows written before: {"step", "path"})
    CHECKPOINT = "checkpoint"
    RESUME = "resume"  # the run resumed from a checkpoint: data {"step"}
    PARTITION = "partition"  # the pipeline's layer partition, from parameter sizes
    REPARTITION = "repartition"  # the partition recomputed from measured layer times
    REFERENCE = "reference"  # a method's reference pass (DPO's log-probabilities), computed or read back
    TRACKER = "tracker"  # an experiment tracker's problem or recovery: data {"tracker", "level"}
    SKIPPED = "skipped"  # a step not applied: its loss or gradient norm was not finite: data {"step", "what"}
    # a job on several boxes joined: data {"hosts": names by rank, "link_gbps", "gradient_bytes"}
    BOXES = "boxes"


class RunStatus(StrEnum):
    """How ``train()`` ended (``TrainResult.status``)."""

    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"


class LayerKind(StrEnum):
    """The engine's layers of a model: embeddings and masks, a decoder block, norm, head and loss."""

    INPUT = "input"
    BLOCK = "block"
    OUTPUT = "output"
