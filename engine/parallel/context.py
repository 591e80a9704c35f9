"""What every worker of one engine shares (``WorkerContext``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from engine.model.adapter import AdaptedModel
from engine.model.router import RouterLoss
from engine.parallel.board import Board
from engine.parallel.host import HostState


@dataclass(frozen=True)
class WorkerContext:
    """What every worker of one engine shares: all a worker sees of the engine.

    Attributes:
        model: the adapted model: the layers each worker copies the structure of, and the
            builder of the blocks' per-micro-batch context.
        host: the host copies the workers upload from.
        board: the blackboard the threads coordinate through.
        cancel: when set, iterations stop between micro-batches (None: never).
        dropout: the model draws random numbers in training (dropout is seeded per layer).
        fp32_accumulate: sum micro-batch weight gradients in fp32 on the device (a low-precision
            compute dtype) before they go down to the host.
        router_loss: the MoE routers' auxiliary loss, when the run adds it.
    """

    model: AdaptedModel
    host: HostState
    board: Board
    cancel: threading.Event | None
    dropout: bool
    fp32_accumulate: bool
    router_loss: RouterLoss | None = None
