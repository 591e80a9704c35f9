"""A job on several boxes, priced: each box plans its share of every batch, and the step adds what
the gradient exchange between the boxes does not hide (``engine.scheduling.exchange``).

Every box runs its own RoundPipe pipeline over its own GPUs (all boxes alike: the one planned)
on its share of each batch: ``ceil(batch_size / hosts)`` examples (a GRPO job's prompts, their
rollouts with them), as ``num_microbatches`` micro-batches, so a box's iteration, its memory and
its longest sequence are those of that share. Before each optimizer step the boxes sum their fp32
gradients of the trained weights over the network; the step is the box's, plus the exchange's
exposed time. ``scaling`` is the job's rate over one box's with the whole batch (the same tokens a
step): what the other boxes buy. Steps, the reference pass of a preference job (counted whole on
each box) and the run's overheads are otherwise one box's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from engine.errors import ConfigError
from engine.planner.overheads import Overheads, overheads
from engine.planner.workload import GB, Workload
from engine.scheduling.exchange import Exchange, exchange

# a link nobody measured: 10 GbE, the usual NIC of a consumer box and of a small office switch
NOMINAL_LINK_GBPS = 10.0
HOSTS_LIMIT = 64  # boxes one job may span
LINK_GBPS_RANGE = (0.01, 10_000.0)  # from a slow Wi-Fi hop to a multi-port InfiniBand link


@dataclass(frozen=True)
class Hosts:
    """The boxes a job spans and the link between them.

    Attributes:
        count: the boxes (1: a single-box job, no exchange).
        link_gbps: the network between them, Gbit/s (the slowest box's).
        link_measured: ``link_gbps`` was measured between the boxes (an all-reduce rate), not
            their NICs' nominal rate (``NOMINAL_LINK_GBPS`` when nothing is known).
    """

    count: int = 1
    link_gbps: float = NOMINAL_LINK_GBPS
    link_measured: bool = False


def check_hosts(hosts: Hosts, workload: Workload) -> None:
    """The box count and link within range, and a batch that gives every box its micro-batches.

    Raises:
        ConfigError: ``hosts`` or ``link_gbps`` out of range; ``hyper.batch_size`` smaller than
            ``hosts x num_microbatches`` (a GRPO job's prompts: smaller than ``hosts``).
    """
    n, rate = hosts.count, hosts.link_gbps
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= HOSTS_LIMIT:
        raise ConfigError("hosts", f"hosts={n!r} must be an integer from 1 to {HOSTS_LIMIT}", value=n)
    low, high = LINK_GBPS_RANGE
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not low <= rate <= high:
        raise ConfigError(
            "link_gbps", f"link_gbps={rate!r} must be a number from {low:g} to {high:g} Gbit/s", value=rate
        )
    w = workload
    least = n if w.samples else n * w.num_microbatches
    if w.batch_size < least:
        need = f"{n} hosts" if w.samples else f"{n} hosts x {w.num_microbatches} micro-batches"
        raise ConfigError(
            "hyper.batch_size",
            f"hyper.batch_size={w.batch_size} is smaller than {need} = {least}: "
            f"every box needs {'a prompt' if w.samples else 'a row per micro-batch'} of each batch",
            value=w.batch_size,
        )


def max_hosts(workload: Workload) -> int:
    """The most boxes the job's batch gives work to, at most ``HOSTS_LIMIT``: a row per
    micro-batch each; a GRPO job's, a prompt each whose completions (``group_size`` a prompt) fill
    its micro-batches (``engine.distributed.required_rows``'s rule)."""
    w = workload
    if not w.samples:
        return max(1, min(HOSTS_LIMIT, w.batch_size // w.num_microbatches))
    group = w.group_size or 1
    fed = [
        k
        for k in range(1, min(HOSTS_LIMIT, w.batch_size) + 1)
        if (w.batch_size // k) * group >= w.num_microbatches
    ]
    return max(fed, default=1)


def share(workload: Workload, hosts: int) -> Workload:
    """What one box trains of each step: the largest share of the batch (``ceil(batch / hosts)``
    examples), as the job's micro-batches."""
    return replace(workload, batch_size=math.ceil(workload.batch_size / hosts))


@dataclass(frozen=True)
class OnHosts:
    """A job's step on several boxes (``price``): one box's share plus the exchange's exposed time.

    Attributes:
        exchange: the step's gradient exchange.
        iteration_s: one box's iteration of its share, plus the exchange's exposed time.
        step_s: ``iteration_s`` plus the box's rollouts (GRPO); 0 when the share does not fit.
        tokens_per_s: the whole job's training tokens a second (every box's share).
        eta_s: the steps, and the reference pass (None: steps unknown, or nothing fits).
        overheads: what the run costs besides its steps (None when nothing fits).
        scaling: the job's rate over one box's with the whole batch (None: either does not fit).
    """

    exchange: Exchange
    iteration_s: float
    step_s: float
    tokens_per_s: float
    eta_s: float | None
    overheads: Overheads | None
    scaling: float | None


def price(
    workload: Workload,
    *,
    hosts: Hosts,
    trainable: int,
    box_iteration_s: float,
    box_step_s: float,
    reference_s: float | None,
    weights_bytes: float,
    update_s: float,
    one_box_step_s: float,
) -> OnHosts:
    """The job on ``hosts`` from the plan of one box's share (``share``) and of the whole batch on
    one box: the exchange of the ``trainable`` weights' gradients priced beside the box's
    iteration.

    Args:
        workload: the job (the whole batch).
        hosts: the boxes and their link.
        trainable: the weights the job trains.
        box_iteration_s: one box's iteration of its share (0: the share does not fit).
        box_step_s: that plus its rollouts (GRPO).
        reference_s: a preference job's reference pass (one box's, over every pair).
        weights_bytes: the base model's compute copy in host RAM (its load).
        update_s: the optimizer's update of the masters (host side), per step.
        one_box_step_s: one box's step with the whole batch (0: it does not fit).
    """
    w = workload
    priced = exchange(
        trainable,
        hosts=hosts.count,
        link_gbps=hosts.link_gbps,
        link_measured=hosts.link_measured,
        iteration_s=box_iteration_s,
        update_s=update_s,
        async_optimizer=w.async_optimizer,
    )
    if not box_iteration_s:
        return OnHosts(priced, 0.0, 0.0, 0.0, None, None, None)
    iteration = box_iteration_s + priced.exposed_s
    step = box_step_s + priced.exposed_s
    eta = step * w.steps + (reference_s or 0.0) if w.steps else None
    mine = share(w, hosts.count)
    besides = overheads(mine, step_s=step, weights_bytes=weights_bytes, trainable=trainable)
    return OnHosts(
        exchange=priced,
        iteration_s=iteration,
        step_s=step,
        tokens_per_s=w.sequences * w.timed_seq_len / iteration,
        eta_s=eta,
        overheads=besides,
        scaling=one_box_step_s / step if one_box_step_s > 0 else None,
    )


def exchange_words(plan: dict[str, Any]) -> str:
    """A plan's boxes and their gradient exchange in words, for the command line (a plan of a job
    on several boxes, as ``PlanReport.to_dict`` gives it)."""
    ex, one, a = plan["exchange"], plan["one_box"] or {}, plan["assumptions"]
    hidden = "hidden behind the next iteration" if ex["hidden"] else f"{ex['exposed_s']:.3f} s a step exposed"
    if plan["scaling"] is not None:
        scale = (
            f"; {plan['scaling']:.2f}x one box's rate ({one['tokens_per_s']:,.0f} tokens/s, the whole batch)"
        )
    else:
        scale = "" if one.get("fits", True) else "; the whole batch does not fit one box"
    link = f"{ex['link_gbps']:g} Gbit/s ({'measured' if ex['link_measured'] else 'nominal'})"
    return (
        f"{plan['hosts']} boxes, {a['rows_per_host']:,} of each batch's {a['batch_size']:,} examples a box: "
        f"gradient exchange {ex['bytes_per_step'] / GB:.3g} GB a box a step over {link}, "
        f"{ex['seconds']:.3f} s, {hidden}{scale}"
    )
