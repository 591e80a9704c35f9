"""Tests for engine.scheduling.multibox: a step on several boxes, its gradient exchange and update."""

import pytest

from engine.scheduling.exchange import GBIT, LINK_EFFICIENCY, ROUND_LATENCY_S
from engine.scheduling.multibox import scaling, simulate_boxes
from engine.scheduling.simulate import plan_from_blocks, simulate, uniform_costs

# a small model in milliseconds per micro-batch: 8 blocks on 4 GPUs, 8 micro-batches
BLOCKS, N, M, HOP = 8, 4, 8, 1.5
COSTS = uniform_costs(BLOCKS, fwd=7.0, bwd=16.0, head_fwd=22.0, head_bwd=44.0)
PLAN = plan_from_blocks(BLOCKS, forward=[4, 4], backward=[0, 2, 2, 2, 2])
LORA = 4_000_000  # 16 MB of fp32 gradients
FULL = 1_000_000_000  # 4 GB


def step(boxes: int, **kw):
    args = dict(num_workers=N, num_microbatches=M, plan=PLAN, hop=HOP, trainable_params=LORA, link_gbps=10.0)
    return simulate_boxes(COSTS, boxes=boxes, **(args | kw))


def ring_ms(params: int, boxes: int, gbps: float) -> float:
    """The ring all-reduce written out: 2(k-1)/k of the fp32 bytes at 85% of the nominal rate, plus
    a round latency per 2(k-1) rounds."""
    sent = 2 * (boxes - 1) / boxes * params * 4
    return 1e3 * (sent / (gbps * GBIT * LINK_EFFICIENCY) + 2 * (boxes - 1) * ROUND_LATENCY_S)


@pytest.mark.parametrize("batch", ["fixed", "per-box"])
def test_one_box_is_the_single_box_simulation(batch: str) -> None:
    sync = simulate(
        "roundpipe-sync", COSTS, num_workers=N, num_microbatches=M, hop=HOP, plan=PLAN, mode="physical"
    )
    steady = simulate(
        "roundpipe-async-steady",
        COSTS,
        num_workers=N,
        num_microbatches=M,
        hop=HOP,
        plan=PLAN,
        mode="physical",
    )
    one = step(1, batch=batch, trainable_params=FULL)
    assert (one.step, one.iteration, one.exchange, one.bytes_per_step) == (
        sync.makespan,
        sync.makespan,
        0.0,
        0.0,
    )
    one_async = step(1, batch=batch, trainable_params=FULL, async_optimizer=True)
    assert one_async.step == steady.makespan
    assert steady.makespan < sync.makespan  # the chain has no fill and drain per step
    # the update overlaps the next iteration (sync: layer by layer; async: all of it) while it
    # fits, and paces the steps when it does not
    for async_optimizer, pipeline in ((False, sync), (True, steady)):
        assert step(1, batch=batch, update=100.0, async_optimizer=async_optimizer).step == pipeline.makespan
        assert step(1, batch=batch, update=5000.0, async_optimizer=async_optimizer).step == 5000.0


def test_sync_adds_the_exchange_exactly() -> None:
    one = step(1, update=30.0)
    for boxes in (2, 3, 8):
        many = step(boxes, update=30.0)
        assert many.exchange == pytest.approx(ring_ms(LORA, boxes, 10.0), rel=1e-12)
        assert many.exposed == many.exchange and not many.hidden
        assert many.step == pytest.approx(many.iteration + many.exchange, rel=1e-12)
        slow_update = step(boxes, update=900.0)
        assert slow_update.iteration < 900.0
        assert slow_update.step == pytest.approx(900.0 + many.exchange, rel=1e-12)
        assert many.bytes_per_step == 2 * (boxes - 1) / boxes * LORA * 4
        # the boxes split the batch: each runs M micro-batches of 1/k the rows, so its pipeline
        # takes 1/k of the time (compute and hops scale together)
        assert many.iteration == pytest.approx(one.iteration / boxes, rel=1e-12)
        assert scaling(one, many) == pytest.approx(one.step / many.step, rel=1e-12)
        assert scaling(one, many) < boxes


def test_async_hides_the_exchange_when_it_fits_and_not_otherwise() -> None:
    lora = step(2, async_optimizer=True, update=10.0)
    assert lora.hidden and lora.exposed == 0.0
    assert lora.step == lora.iteration  # the steady period of a box's half of the batch
    assert lora.exchange + lora.update <= lora.iteration
    full = step(2, async_optimizer=True, update=10.0, trainable_params=FULL)
    assert not full.hidden
    assert full.exchange > full.iteration
    assert full.step == pytest.approx(full.exchange + full.update, rel=1e-12)
    assert full.exposed == pytest.approx(full.exchange + full.update - full.iteration, rel=1e-12)
    # the same exchange in sync mode costs all of itself
    sync = step(2, update=10.0, trainable_params=FULL)
    assert sync.exposed == sync.exchange == full.exchange


@pytest.mark.parametrize("async_optimizer", [False, True])
@pytest.mark.parametrize("params", [LORA, FULL])
def test_a_faster_link_never_slows_a_step(async_optimizer: bool, params: int) -> None:
    steps = [
        step(4, link_gbps=g, trainable_params=params, async_optimizer=async_optimizer).step
        for g in (1.0, 2.5, 10.0, 25.0, 100.0, 400.0)
    ]
    assert steps == sorted(steps, reverse=True)
    if not async_optimizer:  # every exchange is exposed: strictly faster
        assert len(set(steps)) == len(steps)
    # a measured rate is taken as is, a nominal one at LINK_EFFICIENCY
    nominal = step(4, trainable_params=params, link_gbps=10.0)
    measured = step(4, trainable_params=params, link_gbps=10.0, link_measured=True)
    assert measured.exchange < nominal.exchange


def test_per_box_batches_grow_with_the_boxes() -> None:
    one = step(1, batch="per-box", trainable_params=0)
    for boxes in (2, 5):
        many = step(boxes, batch="per-box", trainable_params=0)
        assert many.iteration == one.iteration and many.batch_scale == boxes
        # no gradients: the exchange is its rounds' latency alone, and k times the tokens
        latency = 2 * (boxes - 1) * ROUND_LATENCY_S * 1e3
        assert many.exchange == pytest.approx(latency, rel=1e-12)
        assert scaling(one, many) == pytest.approx(boxes * one.step / (one.step + latency), rel=1e-12)
        with_grads = step(boxes, batch="per-box")
        assert scaling(one, with_grads) < boxes


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="boxes=0"):
        step(0)
    with pytest.raises(ValueError, match="batch='halves'"):
        step(2, batch="halves")
    with pytest.raises(ValueError, match=r"link_gbps=0\.0"):
        step(2, link_gbps=0.0)
    with pytest.raises(ValueError, match=r"update=-1\.0"):
        step(2, update=-1.0)
    with pytest.raises(ValueError, match="batch_rows=16 is fewer than boxes × num_microbatches = 3 × 8"):
        step(3, batch_rows=16)
    assert step(2, batch_rows=16).boxes == 2
    with pytest.raises(ValueError, match="batch_rows=64 applies to batch='fixed'"):
        step(2, batch="per-box", batch_rows=64)
    with pytest.raises(ValueError, match=r"one\.boxes=2"):
        scaling(step(2), step(3))
