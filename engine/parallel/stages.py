"""The stages the running engine trains on: per-layer costs for its partition (a parameter-bytes
proxy, then measured times).

Memory per layer is an estimate: the weights in the compute dtype (twice in a fused/backward
stage for trainable weights: their fp32 gradient accumulators), plus activations of one
micro-batch — the hidden state for a forward stage, and for a block trained with recompute
about 16 hidden-sized tensors (attention and MLP intermediates kept for its backward).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.parallel.board import Iteration
from engine.parallel.host import HostState
from engine.parallel.partition import LayerCost, proxy_costs

ACTIVATIONS_PER_BLOCK_BACKWARD = 16


def memory_costs(
    host: HostState, *, microbatch_tokens: int, hidden_size: int, dtype_bytes: int
) -> list[LayerCost]:
    """Proxy costs (parameter bytes) with memory estimates for one micro-batch size."""
    act = microbatch_tokens * hidden_size * dtype_bytes
    param = [float(host.param_bytes(i)) for i in range(host.num_layers)]
    proxies = proxy_costs(param)
    costs = []
    for i, c in enumerate(proxies):
        grads = 4.0 * host.trainable_numel(i)
        kept = act * (ACTIVATIONS_PER_BLOCK_BACKWARD if 0 < i < host.num_layers - 1 else 2)
        costs.append(LayerCost(c.forward, c.backward, param[i] + 2 * act, param[i] + grads + kept))
    return costs


def measured_costs(iterations: Sequence[Iteration], memory: Sequence[LayerCost]) -> list[LayerCost]:
    """Average per-micro-batch forward and backward time of every layer over ``iterations``.

    A layer's forward runs once per micro-batch in the fused stage, and twice elsewhere (the
    forward stage and the recompute); its backward runs once.

    Raises:
        ValueError: nothing was measured for some layer.
    """
    fwd = [0.0] * len(memory)
    bwd = [0.0] * len(memory)
    runs = [0] * len(memory)
    for it in iterations:
        m = len(it.microbatches)
        for i in range(len(memory)):
            if i not in it.layer_fwd_s or i not in it.layer_bwd_s:
                raise ValueError(f"no time measured for layer {i} in iteration {it.serial}")
            uses = 1 if i >= it.plan.fused.start else 2
            fwd[i] += it.layer_fwd_s[i] / (m * uses)
            bwd[i] += it.layer_bwd_s[i] / m
            runs[i] += 1
    return [
        LayerCost(fwd[i] / runs[i], bwd[i] / runs[i], mem.memory_forward, mem.memory_backward)
        for i, mem in enumerate(memory)
    ]
