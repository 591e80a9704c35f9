"""A job on several boxes, priced by the planner: each box plans its share of the batch, the step
adds the gradient exchange's exposed time, and the figures match the ones worked out by hand for
Llama-3.1-8B (LoRA r=16 on every projection, and every weight) on boxes of 8 GPUs of 24 GB."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.errors import ConfigError
from engine.planner import NOMINAL_LINK_GBPS, Hardware, Hosts, Workload, max_hosts, plan_job
from tests.engine.test_planner import LLAMA_3_8B

BOX = Hardware(num_gpus=8, gpu_memory_gb=24, host_ram_gb=512)
JOB = Workload(seq_len=2048, batch_size=32, num_microbatches=8, steps=100)
# Llama-3.1-8B's LoRA r=16 on q, k, v, o, gate, up, down: r x (in + out) each, 32 blocks
# q, o: 16 x (4096 + 4096); k, v: 16 x (4096 + 1024); gate, up, down: 16 x (4096 + 14336)
LORA_PARAMS = 32 * (2 * 16 * 8192 + 2 * 16 * 5120 + 3 * 16 * 18432)  # 41,943,040
# every weight: embeddings and head 2 x 128256 x 4096, per block attention 2 x 4096^2 +
# 2 x 4096 x 1024, MLP 3 x 4096 x 14336, two norms 2 x 4096; the final norm 4096
FULL_PARAMS = 2 * 128256 * 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096
# a nominal link is priced at 85% of its rate (TCP, gloo's copies); each of a ring's 2 (k - 1)
# rounds pays 100 us of latency
NOMINAL_BYTES_PER_S = 10e9 / 8 * 0.85


def test_lora_on_two_boxes_adds_the_exchange_of_its_adapter_gradients() -> None:
    one = plan_job(LLAMA_3_8B, BOX, JOB)
    two = plan_job(LLAMA_3_8B, BOX, JOB, hosts=Hosts(2))
    half = plan_job(LLAMA_3_8B, BOX, replace(JOB, batch_size=16))  # what one box of the two trains
    assert one.trainable == two.trainable == LORA_PARAMS == 41_943_040
    ex = two.exchange
    assert ex is not None and one.exchange is None and one.scaling is None
    # fp32 gradients, 4 bytes each; a ring of 2 sends 2 (2 - 1) / 2 = 1 times them a box
    assert ex["gradient_bytes"] == ex["bytes_per_step"] == 4 * LORA_PARAMS == 167_772_160
    seconds = 167_772_160 / NOMINAL_BYTES_PER_S + 2 * 100e-6  # 0.158103 s
    assert ex["seconds"] == pytest.approx(seconds, rel=1e-12) and ex["seconds"] == pytest.approx(
        0.158103, abs=1e-6
    )
    assert (ex["link_gbps"], ex["link_measured"], ex["hidden"]) == (NOMINAL_LINK_GBPS, False, False)
    assert ex["exposed_s"] == ex["seconds"]  # the synchronous optimizer waits for all of it
    # a box's step is its half of the batch, plus the exchange; the rate is the whole batch's
    assert two.step_s == pytest.approx(half.step_s + seconds, rel=1e-12)
    assert two.tokens_per_s == pytest.approx(32 * 2048 / two.step_s, rel=1e-12)
    assert two.scaling == pytest.approx(one.step_s / two.step_s, rel=1e-12)
    assert 1.5 < two.scaling < 2  # most of 2x: the exchange and the box's fixed costs lose the rest
    assert two.one_box == {"fits": True, "step_s": one.step_s, "tokens_per_s": one.tokens_per_s}
    assert two.eta_s == pytest.approx(100 * two.step_s, rel=1e-12)
    assert two.total_s == pytest.approx(two.eta_s + two.overheads["total_s"], rel=1e-12)
    # memory and stages are a box's share's
    assert two.stages == half.stages and two.max_seq_len == half.max_seq_len
    assert (two.assumptions["hosts"], two.assumptions["rows_per_host"]) == (2, 16)
    line = next(t for t in two.describe().splitlines() if t.startswith("2 boxes"))
    assert "0.168 GB a box a step over 10 Gbit/s (nominal), 0.158 s" in line
    assert f"{two.scaling:.2f}x one box's rate" in line


def test_a_full_fine_tune_over_three_boxes_is_bound_by_the_exchange() -> None:
    three = plan_job(LLAMA_3_8B, BOX, replace(JOB, method="full", batch_size=24), hosts=Hosts(3))
    assert three.trainable == FULL_PARAMS == 8_030_261_248
    ex = three.exchange
    assert ex is not None
    # a ring of 3: 2 (3 - 1) / 3 = 4/3 of the 32.1 GB of gradients a box, in 4 rounds
    assert ex["bytes_per_step"] == pytest.approx(4 / 3 * 4 * FULL_PARAMS, rel=1e-12)
    seconds = 4 / 3 * 4 * FULL_PARAMS / NOMINAL_BYTES_PER_S + 4 * 100e-6  # 40.31 s
    assert ex["seconds"] == pytest.approx(seconds, rel=1e-12) and ex["seconds"] == pytest.approx(
        40.31, abs=0.01
    )
    third = plan_job(LLAMA_3_8B, BOX, replace(JOB, method="full", batch_size=8))
    assert three.step_s == pytest.approx(third.step_s + seconds, rel=1e-12)
    assert three.scaling is not None and three.scaling < 0.5  # slower than one box: 10 GbE is no match
    # a measured 25 GbE link is taken at its measured rate
    fast = plan_job(
        LLAMA_3_8B,
        BOX,
        replace(JOB, method="full", batch_size=24),
        hosts=Hosts(3, link_gbps=23.5, link_measured=True),
    )
    assert fast.exchange is not None and fast.exchange["link_measured"]
    assert fast.exchange["seconds"] == pytest.approx(4 / 3 * 4 * FULL_PARAMS / (23.5e9 / 8) + 4e-4, rel=1e-12)


def test_the_async_optimizer_hides_an_exchange_that_fits_beside_the_next_iteration() -> None:
    job = replace(JOB, async_optimizer=True)
    two = plan_job(LLAMA_3_8B, BOX, job, hosts=Hosts(2))
    half = plan_job(LLAMA_3_8B, BOX, replace(job, batch_size=16))
    assert two.exchange is not None and two.exchange["hidden"] and two.exchange["exposed_s"] == 0
    assert two.step_s == half.step_s
    # a full fine-tune's 32 GB do not fit: what does not fit beside the iteration is exposed
    full = plan_job(LLAMA_3_8B, BOX, replace(job, method="full"), hosts=Hosts(2))
    box = plan_job(LLAMA_3_8B, BOX, replace(job, method="full", batch_size=16))
    ex = full.exchange
    assert ex is not None and not ex["hidden"]
    update = FULL_PARAMS / 1.5e9  # the planner's host AdamW: 1.5e9 parameters a second
    assert ex["exposed_s"] == pytest.approx(ex["seconds"] + update - box.iteration_s, rel=1e-9)
    assert full.step_s == pytest.approx(box.step_s + ex["exposed_s"], rel=1e-12)


def test_grpo_splits_its_prompts_and_their_rollouts_over_the_boxes() -> None:
    job = Workload(
        seq_len=1024,
        batch_size=4,
        num_microbatches=2,
        method="grpo",
        group_size=4,
        completion_tokens=256,
        steps=10,
    )
    two = plan_job(LLAMA_3_8B, BOX, job, hosts=Hosts(2))
    half = plan_job(LLAMA_3_8B, BOX, replace(job, batch_size=2))
    assert two.rollout is not None and half.rollout is not None
    assert two.rollout["rows"] == half.rollout["rows"] == 8  # 2 prompts x 4 completions a box
    assert two.step_s == pytest.approx(half.step_s + two.exchange["exposed_s"], rel=1e-12)  # type: ignore[index]
    assert two.assumptions["sequences_per_step"] == 16 and two.assumptions["sequences_per_host"] == 8
    # GRPO needs a prompt a box, not a row per micro-batch
    with pytest.raises(ConfigError, match=r"hyper.batch_size=4 is smaller than 5 hosts = 5") as error:
        plan_job(LLAMA_3_8B, BOX, job, hosts=Hosts(5))
    assert error.value.field == "hyper.batch_size"


def test_bad_boxes_name_the_field() -> None:
    with pytest.raises(
        ConfigError, match=r"hyper.batch_size=32 is smaller than 5 hosts x 8 micro-batches = 40"
    ):
        plan_job(LLAMA_3_8B, BOX, JOB, hosts=Hosts(5))
    for hosts, field in [
        (Hosts(0), "hosts"),
        (Hosts(65), "hosts"),
        (Hosts(True), "hosts"),  # type: ignore[arg-type]
        (Hosts(2, link_gbps=0.0), "link_gbps"),
        (Hosts(2, link_gbps=float("nan")), "link_gbps"),
    ]:
        with pytest.raises(ConfigError) as error:
            plan_job(LLAMA_3_8B, BOX, JOB, hosts=hosts)
        assert error.value.field == field and field in str(error.value)


def test_a_share_that_fits_where_the_whole_batch_does_not() -> None:
    """Each box's micro-batches are a share of the rows: a batch whose micro-batches do not fit one
    box's GPUs fits two boxes; the scaling then has no one-box rate to compare with."""
    job = replace(JOB, seq_len=16384, batch_size=16, num_microbatches=1)
    one = plan_job(LLAMA_3_8B, replace(BOX, num_gpus=1), job)
    two = plan_job(LLAMA_3_8B, replace(BOX, num_gpus=1), job, hosts=Hosts(16))
    assert not one.fits and two.fits
    assert two.scaling is None and two.one_box == {"fits": False, "step_s": 0.0, "tokens_per_s": 0.0}
    assert "the whole batch does not fit one box" in two.describe()


@pytest.mark.parametrize(
    "batch,microbatches,group",
    [(4, 2, None), (16, 4, None), (5, 2, None), (3, 4, 2), (8, 4, 2), (12, 16, 6), (7, 3, 1)],
)
def test_max_hosts_is_the_most_boxes_the_engine_accepts(batch, microbatches, group) -> None:
    """The planner's count of boxes (the plan's "auto") and the engine's refusal agree."""
    from types import SimpleNamespace

    from engine.distributed import required_rows
    from engine.errors import ConfigError

    method = SimpleNamespace(group_size=group) if group else SimpleNamespace()
    config = SimpleNamespace(
        hyper=SimpleNamespace(batch_size=batch),
        engine=SimpleNamespace(num_microbatches=microbatches),
        method=method,
    )
    accepted = 1
    for k in range(2, 65):
        try:
            required_rows(config, k)  # type: ignore[arg-type]
        except ConfigError:
            continue
        accepted = k
    workload = Workload(
        batch_size=batch, num_microbatches=microbatches, method="grpo" if group else "lora", group_size=group
    )
    assert max_hosts(workload) == accepted
