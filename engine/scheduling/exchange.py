"""The gradient exchange of a job that spans several boxes: its bytes, its time, and whether the
step hides it.

Every box trains its share of the batch and holds the whole model (weights, fp32 masters and
moments in its host memory); before each optimizer step the boxes sum their fp32 gradients of
the trained weights with a ring all-reduce (torch.distributed's gloo, the gradients being host
tensors). A ring over ``k`` boxes sends and receives ``2 (k - 1) / k`` times the gradients'
bytes per box, in ``2 (k - 1)`` rounds, each paying the link's latency once.

Where it hides: with the synchronous optimizer the exchange sits between the last micro-batch's
backward and the step, so it adds to every step. With the asynchronous optimizer (staleness 1)
the exchange and the update run on the optimizer thread while the next iteration computes on the
weights one step older, so it is hidden when exchange + update fit inside one iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
# what a TCP ring all-reduce gets of a link's nominal rate (headers, gloo's copies, the kernel's
# socket buffers): a first-order figure for 10-25 GbE, replaced by a measured rate where one is known
LINK_EFFICIENCY = 0.85
# one round's latency on a switched LAN (two hops, the gloo handshake of a chunk)
ROUND_LATENCY_S = 100e-6
FP32_BYTES = 4


@dataclass(frozen=True)
class Exchange:
    """One step's gradient exchange over ``hosts`` boxes.

    Attributes:
        hosts: the boxes in the job (1: no exchange).
        gradient_bytes: the fp32 gradients each box holds (the trained weights' count x 4).
        bytes_per_step: what each box sends (and receives) per step.
        seconds: the exchange's time per step.
        link_gbps: the link rate it was priced at (Gbit/s).
        link_measured: that rate was measured on the hosts (False: their NICs' nominal rate).
        hidden: the step hides it (asynchronous optimizer, and it fits in one iteration).
        exposed_s: what it adds to a step: all of it with the synchronous optimizer, what does
            not fit beside the next iteration with the asynchronous one (0 when hidden).
    """

    hosts: int
    gradient_bytes: float
    bytes_per_step: float
    seconds: float
    link_gbps: float
    link_measured: bool
    hidden: bool
    exposed_s: float


def ring_bytes(gradient_bytes: float, hosts: int) -> float:
    """What each box sends per all-reduce of ``gradient_bytes`` over a ring of ``hosts``."""
    if hosts <= 1:
        return 0.0
    return 2.0 * (hosts - 1) / hosts * gradient_bytes


def exchange_seconds(gradient_bytes: float, hosts: int, link_gbps: float, *, measured: bool = False) -> float:
    """The time of one ring all-reduce of ``gradient_bytes`` over ``hosts`` boxes on links of
    ``link_gbps`` (a measured rate is taken as is; a nominal one at ``LINK_EFFICIENCY``)."""
    if hosts <= 1:
        return 0.0
    if link_gbps <= 0:
        raise ValueError(f"link_gbps={link_gbps}: must be > 0")
    rate = link_gbps * GBIT * (1.0 if measured else LINK_EFFICIENCY)
    return ring_bytes(gradient_bytes, hosts) / rate + 2 * (hosts - 1) * ROUND_LATENCY_S


def exchange(
    trainable_params: int,
    *,
    hosts: int,
    link_gbps: float,
    link_measured: bool = False,
    iteration_s: float,
    update_s: float = 0.0,
    async_optimizer: bool = False,
) -> Exchange:
    """Price one step's gradient exchange.

    Args:
        trainable_params: the weights the job trains (a LoRA adapter's, or every weight).
        hosts: the boxes in the job.
        link_gbps: the link between the boxes, Gbit/s (the slowest box's).
        link_measured: ``link_gbps`` was measured (an earlier job's exchange), not nominal.
        iteration_s: one box's forward and backward of its share of the batch.
        update_s: the optimizer's update of the masters (host side).
        async_optimizer: the step runs beside the next iteration (staleness 1).
    """
    grads = float(trainable_params) * FP32_BYTES
    seconds = exchange_seconds(grads, hosts, link_gbps, measured=link_measured)
    hidden = hosts > 1 and async_optimizer and seconds + update_s <= iteration_s
    if hosts <= 1 or hidden:
        exposed = 0.0
    elif async_optimizer:  # the part of exchange + update the next iteration does not cover
        exposed = min(seconds, seconds + update_s - iteration_s)
    else:
        exposed = seconds
    return Exchange(
        hosts=hosts,
        gradient_bytes=grads,
        bytes_per_step=ring_bytes(grads, hosts),
        seconds=seconds,
        link_gbps=link_gbps,
        link_measured=link_measured,
        hidden=hidden,
        exposed_s=exposed,
    )
