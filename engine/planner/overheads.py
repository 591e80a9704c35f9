"""What a run costs besides its steps, so that an ETA is the run end to end: the trainer's start
(and exit), the base model's load, the data's preparation, the first step's warm-up, the
validation passes and the checkpoints (``overheads``). A run measured on the box prices them
better: its wall time less its steady steps (``measured_overhead``).

The constants are first-order. The start and the warm-up, the large terms, were read off runs of
the demo model (SmolLM2-135M, LoRA, one CPU worker) and of the test suite's tiny Llama on a
shared 2-core x86-64 host (``bench/sweep_price.py``), where the load of other work made them
several times longer than on a quiet box; the rates of the load, the data and the checkpoints
are assumed (a second or less for the demo). That is why runs measured on the box replace them
where there are any (``server.services.plans``): the estimate says which.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from engine.planner.workload import GB, Workload, bytes_per_trainable_param

# the trainer process: the interpreter, torch, transformers and peft imported, the job read from
# the database, and at the end the engine closed and the result recorded (on the shared host:
# 19 s from the claim to the engine's first event, the model's load and the data included, at a
# load average of 7; importing torch alone took 3 to 11 s at load averages of 6 to 12)
START_S = 8.0
# the base model's compute copy read from safetensors (or the page cache) and converted
LOAD_GB_S = 0.5
# training rows read, rendered with the chat template and tokenized
ROWS_PER_S = 2000.0
# the first step's extra over a steady one: the engine's threads and buffers, the first kernels
# and allocations. On a CPU worker the first step took about six steady steps (the tiny Llama's
# 3.1 s against 0.5 s; the demo's 36 s against 5.5 s at a load average of 7), and up to 18 on a
# busier box (the demo's 174 s against 9.9 s at 12); on a GPU the CUDA context and the kernels'
# first launches come on top
WARMUP_STEPS = 5.0
# a validation pass: a forward over every held-out row, about a third of a training step's work
# per sequence (no backward, no recompute)
FORWARD_SHARE = 1 / 3
# a checkpoint: the trainable weights (fp32) and their optimizer state written, plus the files
# of the export (config, tokenizer, model card)
SAVE_GB_S = 0.5
SAVE_FIXED_S = 0.3


@dataclass(frozen=True)
class Overheads:
    """A run's costs besides its steps, in seconds, by term (``total_s``: their sum)."""

    start_s: float
    load_s: float
    data_s: float
    warmup_s: float
    validation_s: float
    save_s: float

    @property
    def total_s(self) -> float:
        return self.start_s + self.load_s + self.data_s + self.warmup_s + self.validation_s + self.save_s

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"total_s": self.total_s}


def overheads(workload: Workload, *, step_s: float, weights_bytes: float, trainable: int) -> Overheads:
    """The planner's estimate of what a run costs besides its ``steps`` steps.

    Args:
        workload: the run; ``rows``, ``validation_rows``, ``eval_every`` and ``checkpoint_every``
            count the data's preparation, the validation passes and the checkpoints (no rows
            known: no data term, no validation).
        step_s: one steady step (the plan's, rollouts included).
        weights_bytes: the compute copy of the base model's weights (host RAM's ``weights_gb``).
        trainable: the trained parameters (the checkpoint's weights and optimizer state).

    Returns:
        The terms; ``validation_s`` and ``save_s`` are 0 when the step count is unknown.
    """
    w = workload
    steps = w.steps or 0
    passes = 0
    if w.validation_rows and steps:
        between = (steps - 1) // w.eval_every if w.eval_every else 0  # the loop's, then one at the end
        passes = between + 1
    per_sequence = step_s / max(1, w.sequences)
    validation = passes * w.validation_rows * w.sequences_per_example * per_sequence * FORWARD_SHARE
    saves = math.ceil(steps / w.checkpoint_every) if steps else 0
    checkpoint = trainable * (4 + bytes_per_trainable_param(w.optimizer))
    return Overheads(
        start_s=START_S,
        load_s=weights_bytes / (LOAD_GB_S * GB),
        data_s=(w.rows or 0) / ROWS_PER_S,
        warmup_s=WARMUP_STEPS * step_s,
        validation_s=validation,
        save_s=saves * (SAVE_FIXED_S + checkpoint / (SAVE_GB_S * GB)),
    )


def measured_overhead(*, duration_s: float, steps: int, step_times: Sequence[float]) -> float:
    """What a finished run spent besides its steady steps: its wall time (claimed to finished)
    less ``steps`` steps at the median of its step times after the first (the first one's
    warm-up is part of the overhead; a run of one step has only that one).

    Raises:
        ValueError: no step time, a non-positive duration or step count.
    """
    if not step_times or duration_s <= 0 or steps < 1:
        raise ValueError(
            f"a measured run needs its duration, steps and step times "
            f"(duration_s={duration_s!r}, steps={steps!r}, {len(step_times)} step times)"
        )
    steady = statistics.median(step_times[1:] or step_times)
    return max(0.0, duration_s - steps * steady)
