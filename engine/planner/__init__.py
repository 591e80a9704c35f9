"""Will a job fit, and how long will it take? A plan from a model's ``config.json`` and the hardware.

Pure arithmetic on the model's shapes (no weights, no torch): parameter counts per engine layer
(input layer, decoder blocks — dense or mixtures of experts — and output layer; ``shapes``), the
host RAM RoundPipe needs (the compute copy of the weights, fp32 masters, gradients and optimizer
state of the trainable parameters, the stage inputs kept for recompute), and per stage the GPU
memory of its worker, term by term (``memory``: weights, the next stage's prefetched weights,
activations, the loss's logits chunk, gradient buffers, workspace). Times come from FLOPs at an
assumed fraction of the GPUs' peak rate; the engine's own partitioner picks the stages within the
GPU memory, and the schedule simulator (physical mode, weight uploads over the host link) gives the
iteration time. ``report`` puts it together, with the longest sequence that fits. A job that ran
calibrates the rate: ``calibrate`` scales the assumed efficiency by measured over predicted
throughput. The job comes in as the run's own ``TrainConfig`` (``Workload.from_train_config``),
so the CLI, the service and the web form plan the same thing. A host whose workers report no GPU
is planned as one CPU worker (``Hardware.cpu_host``) at an assumed, measured fp32 rate per core;
the training data's token counts, when given, set the sequence length times are computed at.
A DPO job is the LoRA or full plan of its ``dpo_tuning`` at 2 sequences a pair (its micro-batches
hold both sequences of their pairs), plus the reference pass the engine runs once before the first
step, a forward over every training and validation pair (``reference``), in the ETA.

A LoRA job's base may be kept in 4 bits (``Workload.base_bits``): its blocks' frozen matrices
count packed in host RAM and on PCIe, and on the GPU packed plus decoded (``quantized``); the
report puts the job with either base side by side (``PlanReport.base_variants``), each with its
own partition and longest sequence (``fit``).

The estimates are first-order: activation sizes assume fused (flash) attention, the optimizer is
assumed hidden behind the next iteration unless it is slower than it, and communication other than
weight uploads and stage-boundary hops is ignored.

An ETA counts the run end to end (``PlanReport.total_s``): the steps, and what a run costs besides
them (``overheads``: the trainer's start, the model's load, the data's preparation, the first
step's warm-up, validation passes, checkpoints), assumed, or measured from a run on the same box
(``measured_overhead``, ``use_measured_overhead``).

A job may span several boxes (``Hosts``: their count and the network between them, measured or
nominal): each box plans its share of every batch, and the step adds what the gradient exchange
between the boxes leaves exposed (``boxes``, ``exchange``); the report says the exchange's bytes
and time, whether the asynchronous optimizer hides it, and the job's rate over one box's.
"""

from engine.methods.reference import reference_seconds
from engine.planner.boxes import HOSTS_LIMIT, NOMINAL_LINK_GBPS, Hosts, max_hosts
from engine.planner.calibration import calibrate, use_measured_overhead
from engine.planner.fit import SEQ_LEN_STEP, longest_sequence
from engine.planner.memory import CUDA_OVERHEAD_BYTES, Memory, layer_times, memory_model
from engine.planner.overheads import Overheads, measured_overhead, overheads
from engine.planner.report import PlanReport, hardware_label, plan_job
from engine.planner.shapes import SHAPE_LIMITS, Shape
from engine.planner.vision import image_stats
from engine.planner.workload import (
    CPU_GFLOPS_PER_CORE,
    DTYPE_BYTES,
    GB,
    HARDWARE_RANGES,
    WORKLOAD_LIMITS,
    Hardware,
    Workload,
    batch_length,
    bytes_per_trainable_param,
)

__all__ = [
    "CPU_GFLOPS_PER_CORE",
    "CUDA_OVERHEAD_BYTES",
    "DTYPE_BYTES",
    "GB",
    "HARDWARE_RANGES",
    "HOSTS_LIMIT",
    "NOMINAL_LINK_GBPS",
    "SEQ_LEN_STEP",
    "SHAPE_LIMITS",
    "WORKLOAD_LIMITS",
    "Hardware",
    "Hosts",
    "Memory",
    "Overheads",
    "PlanReport",
    "Shape",
    "Workload",
    "batch_length",
    "bytes_per_trainable_param",
    "calibrate",
    "hardware_label",
    "image_stats",
    "layer_times",
    "longest_sequence",
    "max_hosts",
    "measured_overhead",
    "memory_model",
    "overheads",
    "plan_job",
    "reference_seconds",
    "use_measured_overhead",
]
