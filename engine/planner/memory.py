"""GPU memory and time of one worker's stages, term by term, and the partition that fits them.

A worker holds one stage at a time, for one micro-batch of ``t`` tokens at a time (``d`` is the
compute dtype's bytes, ``h`` the hidden size). Its bytes are:

- **weights**: the stage's parameters in the compute dtype — every expert's in a
  mixture-of-experts block (the upload is the whole stage);
- **prefetch**: the weights of the next stage queued on the worker (slot ``i + N`` of the round
  for slot ``i`` and ``N`` workers), uploaded while this one computes;
- **activations** (fused and backward stages): what autograd keeps of each block for its
  backward, measured: per token, the family's coefficients over the block's widths
  (``engine.planner.activations``, fitted from saved-tensor measurements of small blocks): the
  norms' inputs (in fp32 under a bf16 model), q/k/v, the attention output and its log-sum-exp
  (fused attention, no scores), the MLP's gate/up/activation outputs of the experts a token
  visits, the router's logits and the tokens dispatched to experts — 26.5 hidden-sized tensors
  a token for a bf16 Llama-3.2-1B block. A family the table lacks (DeepSeek-V3, GPT-OSS) is
  counted tensor by tensor from its widths, as before;
- **logits** (the output layer, in the fused stage): the loss runs in chunks of
  ``loss_chunk_tokens`` positions (``engine.model.loss``), so one chunk's ``[chunk, vocab]``
  fp32 logits and their fp32 gradient, plus the head's output in the compute dtype, never the
  whole micro-batch's logits (as ``engine.parallel.stages.memory_costs``);
- **gradients** (trained weights, fused and backward stages): the fp32 accumulator the engine
  sums micro-batches into (4 bytes a weight) and the current micro-batch's gradient in the
  compute dtype, as ``engine.parallel.stages.memory_costs``; in fp32 the gradient accumulates
  in place, one 4-byte buffer (the engine's estimate counts two);
- **workspace**, once per stage: its input and output hidden states and the gradient arriving
  from above (3 t h d), and the largest transient of one layer: the MLP intermediates of a
  forward without autograd, or of a block's recompute (3 t x MLP width x d).

With a 4-bit base (``Workload.base_bits``, ``engine.planner.quantized``) the weights and the
prefetch are the blocks' *packed* bytes (what is uploaded), and a stage also holds
- **dequantized**: the dense copies its worker decodes from the packed weights at the stage's
  start, plus the scratch of decoding the stage's largest packed tensor.

A LoRA job's weights include its adapters' compute copy (uploaded with the base).

A vision-language model's input layer holds its vision tower and projector
(``engine.planner.vision``): their weights (and LoRA adapters, and a LoRA run's trained copy of a
part it trains whole) upload with it, and when either
trains it keeps their activations over the micro-batch's image patches; the tower's MLP over
those patches is a transient of the workspace, and its FLOPs are the input layer's time.

Everything is per worker: the CUDA context (``CUDA_OVERHEAD_BYTES``) is per GPU, and when a run
puts several workers on one GPU they divide what is left of its memory. The partition packs
stages as the engine does (each layer's weights twice: its own and the prefetch), then checks
every stage with its real successor (:func:`fitting_plan`); one layer per stage is the last
resort, so a job fits the GPUs exactly when every single layer does (:func:`layers_fit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from engine.planner.activations import block_bytes_per_token
from engine.planner.quantized import FP32_BYTES, block_bytes
from engine.planner.shapes import Shape
from engine.planner.vision import ImageCost
from engine.planner.workload import DTYPE_BYTES, GB, Hardware, Workload
from engine.scheduling.partition import LayerCost, Plan, StageKind, auto_partition, fewest_stages

CUDA_OVERHEAD_BYTES = 0.8 * GB  # CUDA context, allocator slack and workspace per GPU
PREFETCH_ROUNDS = 2  # partitions tried before one layer per stage (the second with a cut budget)


@dataclass(frozen=True)
class Memory:
    """Per-worker GPU bytes of one job on one box, by engine layer and per stage.

    ``weights``, ``activations``, ``gradients`` and ``logits`` are per layer (what a fused or
    backward stage holding the layer needs; a forward stage needs only the weights); ``workspace``
    is once per stage; ``capacity`` is what one worker may use. ``weights`` are what a layer
    uploads (a 4-bit base's packed bytes); ``decoded`` the dense copies of its packed weights a
    running stage holds, and ``scratch`` what decoding its largest packed tensor takes (once per
    stage: the largest of its layers'); both empty without a 4-bit base.
    """

    capacity: float
    workspace: float
    weights: list[float]
    activations: list[float]
    gradients: list[float]
    logits: list[float]
    decoded: list[float] = field(default_factory=list)
    scratch: list[float] = field(default_factory=list)

    def _decoded(self, i: int) -> float:
        return self.decoded[i] if self.decoded else 0.0

    def _scratch(self, layers: range | Sequence[int]) -> float:
        return max((self.scratch[i] for i in layers), default=0.0) if self.scratch else 0.0

    def costs(self, times: Sequence[tuple[float, float]]) -> list[LayerCost]:
        """Layer costs for the partitioner: ``times`` (forward, backward) per layer and the
        additive memory terms (the once-per-stage ones come off the budget)."""
        held = [w + self._decoded(i) for i, w in enumerate(self.weights)]
        return [
            LayerCost(
                forward=f,
                backward=b,
                memory_forward=w,
                memory_backward=w + a + g + x,
            )
            for (f, b), w, a, g, x in zip(
                times, held, self.activations, self.gradients, self.logits, strict=True
            )
        ]

    def largest_layer(self) -> float:
        """Bytes of the hungriest single-layer stage, with its workspace and the largest prefetch."""
        terms = zip(self.weights, self.activations, self.gradients, self.logits, strict=True)
        own = max(
            w + self._decoded(i) + self._scratch((i,)) + a + g + x for i, (w, a, g, x) in enumerate(terms)
        )
        return own + self.workspace + max(self.weights)

    def stage_extra(self) -> float:
        """Once-per-stage bytes the partitioner keeps off its budget: the workspace and the
        largest decoding scratch of any layer."""
        return self.workspace + self._scratch(range(len(self.weights)))

    def stage_terms(self, plan: Plan, slot: int, num_workers: int) -> dict[str, float]:
        """The terms of one stage of ``plan``, in bytes (``total`` their sum)."""
        stage = plan.slots[slot]
        nxt = plan.slots[(slot + num_workers) % plan.num_slots]
        backward = stage.kind != StageKind.FORWARD
        a, z = stage.start, stage.stop
        terms = {
            "weights": sum(self.weights[a:z]),
            "prefetch": sum(self.weights[nxt.start : nxt.stop]),
            "activations": sum(self.activations[a:z]) if backward else 0.0,
            "gradients": sum(self.gradients[a:z]) if backward else 0.0,
            "logits": sum(self.logits[a:z]) if backward else 0.0,
            "workspace": self.workspace,
            "dequantized": sum(self.decoded[a:z]) + max(self.scratch[a:z]) if self.decoded else 0.0,
        }
        terms["total"] = sum(terms.values())
        return terms


def memory_model(shape: Shape, workload: Workload, hardware: Hardware, trainable: Sequence[int]) -> Memory:
    """The memory terms of a job (see the module's docstring).

    Args:
        shape: the model's sizes.
        workload: the job; its micro-batch is ``sequences * seq_len / num_microbatches`` tokens
            (a DPO pair's two sequences share one).
        hardware: the GPUs.
        trainable: trainable parameters per engine layer.
    """
    w = workload
    d = DTYPE_BYTES[w.compute_dtype]
    t = w.sequences * w.seq_len / w.num_microbatches
    h = shape.hidden
    base = base_bytes(shape, d, w.base_bits)
    weights = list(base.weights)
    if w.tuning == "lora":  # the blocks' adapters' compute copy rides with the base
        weights = [
            b + (n * d if 0 < i <= shape.layers else 0)
            for i, (b, n) in enumerate(zip(weights, trainable, strict=True))
        ]
    # LoRA on the vision tower or projector, and the trained copies of the parts a LoRA run trains whole
    weights[0] += (vision_adapters(shape, w) + vision_copies(shape, w)) * d
    grad_bytes = 4 + (d if d < 4 else 0)
    per_token, width = _activations(shape, w.compute_dtype)
    chunk = min(float(w.loss_chunk_tokens), t)
    logits = [0.0] * (shape.layers + 1) + [chunk * shape.vocab * (4 + 4 + d)]
    workers_per_gpu = w.workers_per_gpu()
    activations = [t * a for a in per_token]
    transient = 3 * t * width
    images = microbatch_images(shape, w)
    if images is not None and shape.tower is not None:
        tower, (cost, count) = shape.tower, images
        trains_tower = w.vision_tower != "frozen"
        if trains_tower or w.projector != "frozen":
            activations[0] += tower.activation_bytes(count * cost.patches, d, tower=trains_tower)
        transient = max(transient, (3 if tower.gated else 2) * count * cost.patches * tower.intermediate)
    return Memory(
        capacity=(hardware.gpu_memory_gb * GB - CUDA_OVERHEAD_BYTES) / workers_per_gpu,
        workspace=t * d * 3 * h + transient * d,
        weights=weights,
        activations=activations,
        gradients=[float(n * grad_bytes) for n in trainable],
        logits=logits,
        decoded=list(base.decoded) if w.base_bits != 16 else [],
        scratch=list(base.scratch) if w.base_bits != 16 else [],
    )


@dataclass(frozen=True)
class BaseBytes:
    """Per engine layer: the base's upload bytes, its decoded bytes and decoding scratch on a
    worker (``engine.planner.quantized``); only blocks pack."""

    weights: tuple[float, ...]
    decoded: tuple[float, ...]
    scratch: tuple[float, ...]


@lru_cache(maxsize=256)
def base_bytes(shape: Shape, dtype_bytes: int, base_bits: int) -> BaseBytes:
    """The base model's bytes per engine layer with a ``base_bits`` base (16: every weight in the
    compute dtype)."""
    params = shape.layer_params()
    blocks = [block_bytes(shape, b, dtype_bytes, base_bits) for b in range(shape.layers)]
    return BaseBytes(
        weights=(
            float(params[0] * dtype_bytes),
            *(float(b.upload) for b in blocks),
            float(params[-1] * dtype_bytes + shape.head_fp32 * (FP32_BYTES - dtype_bytes)),
        ),
        decoded=(0.0, *(float(b.decoded) for b in blocks), 0.0),
        scratch=(0.0, *(float(b.scratch) for b in blocks), 0.0),
    )


@lru_cache(maxsize=256)
def _activations(shape: Shape, dtype: str) -> tuple[tuple[float, ...], int]:
    """Bytes autograd keeps per token of each engine layer, and the widest MLP of a block."""
    d = DTYPE_BYTES[dtype]
    h = shape.hidden
    # widths of q, k, v and the attention output
    if shape.mla is None:
        q = out = shape.heads * shape.head_dim
        k = v = shape.kv_heads * shape.head_dim
    else:
        m = shape.mla
        q = k = shape.heads * (m.nope + m.rope)
        v = out = shape.heads * m.v
    widths = [shape.mlp_width(b) for b in range(shape.layers)]
    acts = [0.0]
    for b, width in enumerate(widths):
        measured = block_bytes_per_token(shape, b, dtype)
        if measured is not None:
            acts.append(measured)
            continue
        # two norm inputs, the residual, q, k, v, attention output and o_proj output, gate/up/act
        per_token = d * (3 * h + q + k + v + out + h + 3 * width)
        if shape.moe is not None and shape.is_moe_block(b):
            per_token += d * shape.moe.active * h + 4 * shape.moe.experts  # dispatched tokens, router
        if shape.mla is not None:
            per_token += d * (shape.mla.q_rank + shape.mla.kv_rank + shape.mla.rope)  # the latents
        acts.append(float(per_token))
    acts.append(float(h * d))  # the final norm's input
    return tuple(acts), max(widths)


def layers_fit(memory: Memory) -> bool:
    """Whether a plan of one layer per stage fits: then :func:`fitting_plan` finds a plan."""
    return memory.largest_layer() <= memory.capacity


def fitting_plan(
    memory: Memory, costs: Sequence[LayerCost], *, num_workers: int, num_microbatches: int
) -> Plan | None:
    """The engine's partition within each worker's capacity, prefetch and workspace included.

    The partitioner packs stages within ``capacity - workspace``, each layer counting its weights
    twice: its own and, as the engine's estimate assumes, as much again prefetched. A stage
    followed by a heavier one can then overshoot: another pass with the budget cut by the
    overshoot, and a plan of one layer per stage as the last resort (it fits whenever every
    layer does).

    Returns:
        None when not even one layer per stage fits (:func:`layers_fit`).
    """
    if not layers_fit(memory):
        return None
    doubled = [
        LayerCost(c.forward, c.backward, c.memory_forward + w, c.memory_backward + w)
        for c, w in zip(costs, memory.weights, strict=True)
    ]
    need = max(max(c.memory_forward, c.memory_backward) for c in doubled)
    budget = memory.capacity - memory.stage_extra()
    for _ in range(PREFETCH_ROUNDS):
        if budget < need:  # the cut leaves some layer no room
            break
        budget = max(budget, 1.0)
        plan = auto_partition(
            doubled, num_workers=num_workers, num_microbatches=num_microbatches, memory_budget=budget
        )
        over = peak(memory, plan, num_workers) - memory.capacity
        if over <= 0:
            return plan
        budget -= over
    n = len(costs)
    return Plan.from_counts(n, forward=[1] * (n - 1), fused=1, backward=[1] * (n - 1))


def fewest_boundaries(memory: Memory, costs: Sequence[LayerCost]) -> int:
    """A lower bound on the stage inputs (``Plan.checkpoint_boundaries``) of the plan
    :func:`fitting_plan` finds, from one greedy pass: no plan within its budget (nor a smaller
    one's, nor one layer per stage) has fewer. Only for a job whose layers fit (``layers_fit``)."""
    doubled = [
        LayerCost(c.forward, c.backward, c.memory_forward + w, c.memory_backward + w)
        for c, w in zip(costs, memory.weights, strict=True)
    ]
    budget = max(memory.capacity - memory.stage_extra(), 1.0)
    try:
        plan = fewest_stages(doubled, memory_budget=budget)
    except ValueError:  # the budget less the workspace leaves some layer no room: one per stage
        return len(costs) - 2
    return len(plan.checkpoint_boundaries())


def peak(memory: Memory, plan: Plan, num_workers: int) -> float:
    """The largest stage's bytes on a worker, prefetch and workspace included."""
    return max(memory.stage_terms(plan, i, num_workers)["total"] for i in range(plan.num_slots))


def layer_times(shape: Shape, workload: Workload, hardware: Hardware) -> list[tuple[float, float]]:
    """Forward and backward seconds of one micro-batch through each engine layer.

    FLOPs: two per active weight and token (a mixture-of-experts block counts the experts a token
    visits), plus causal attention's scores and weighted sum; the backward is one forward's FLOPs
    for the input gradients, and another for the weight gradients of a full fine-tune (DPO's by
    its ``dpo_tuning``). A DPO micro-batch holds both sequences of its pairs.
    """
    w = workload
    length = w.timed_seq_len  # the data's padded length when known (memory plans seq_len)
    t = w.sequences * length / w.num_microbatches
    rate = hardware.gpu_tflops * 1e12 * hardware.efficiency
    bwd_factor = 1.0 if w.tuning == "lora" else 2.0
    if shape.mla is None:
        score = shape.heads * shape.head_dim * 2
    else:
        score = shape.heads * (shape.mla.nope + shape.mla.rope + shape.mla.v)
    times = [vision_times(shape, w, rate)]  # the embedding lookup (and a VLM's tower)
    for active in _active_params(shape):
        fwd = (2.0 * active + length * score) * t / rate
        times.append((fwd, bwd_factor * fwd))
    head = 2.0 * shape.hidden * shape.vocab * t / rate
    times.append((head, bwd_factor * head))
    return times


def microbatch_images(shape: Shape, workload: Workload) -> tuple[ImageCost, float] | None:
    """A VLM job's image: its cost (``Tower.image`` at ``workload.image_size``) and the images of
    one micro-batch; None for a text model or a job without images."""
    w = workload
    if shape.tower is None or not w.images_per_row:
        return None
    return shape.tower.image(*w.image_size), w.sequences / w.num_microbatches * w.images_per_row


def vision_adapters(shape: Shape, workload: Workload) -> int:
    """The LoRA adapters' parameters on a VLM's tower and projector (``"lora"`` parts only)."""
    w = workload
    if shape.tower is None:
        return 0
    return shape.tower.trainable(
        tower="lora" if w.vision_tower == "lora" else "frozen",
        projector="lora" if w.projector == "lora" else "frozen",
        rank=w.lora_r,
    )


def vision_copies(shape: Shape, workload: Workload) -> int:
    """The parameters of the trained copies a LoRA run keeps beside a VLM's frozen tower or
    projector when it trains one whole (peft's ``modules_to_save``: the copy trains, the original
    stays); a tower that holds its projector (Qwen2.5-VL's) is copied with it."""
    w, tower = workload, shape.tower
    if tower is None or w.tuning != "lora":
        return 0
    count = 0
    if w.vision_tower == "full":
        count += tower.tower_params + (tower.projector_params if tower.projector_inside else 0)
    if w.projector == "full" and not (tower.projector_inside and w.vision_tower == "full"):
        count += tower.projector_params
    return count


def vision_times(shape: Shape, workload: Workload, rate: float) -> tuple[float, float]:
    """Forward and backward seconds of a VLM's tower and projector over one micro-batch's images
    (the input layer's; nothing for a text model): the backward runs through what trains (a
    full part's weight gradients twice, a LoRA part's once) and through the projector when the
    tower below it trains."""
    w = workload
    images = microbatch_images(shape, w)
    if images is None or shape.tower is None:
        return 0.0, 0.0
    tower, (cost, count) = shape.tower, images
    patches = count * cost.patches
    body = tower.block_flops(patches, cost.patches) / rate
    head = tower.projector_flops(patches) / rate
    factor = {"frozen": 0.0, "lora": 1.0, "full": 2.0}
    below = factor[w.vision_tower]
    back = below * body + max(factor[w.projector], 1.0 if below else 0.0) * head
    return body + head, back


@lru_cache(maxsize=256)
def _active_params(shape: Shape) -> tuple[int, ...]:
    """The parameters one token computes with in each block."""
    return tuple(shape.active_block_params(b) for b in range(shape.layers))
