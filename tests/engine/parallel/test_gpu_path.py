"""Safeguards of the GPU path that hold on CPU workers too: device lists, the memory budget and
estimates, pinned blocks, prefetch out of memory, float16 that never recovers, dropped frames."""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch

from engine import Cancelled, EngineConfig, EngineError, RoundPipe
from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.model.adapter import AdaptedModel
from engine.parallel.executor import Worker
from engine.parallel.host import DTYPES, HostState
from engine.parallel.stages import GPU_MEMORY_SHARE, memory_budget, memory_costs
from tests.engine.tiny import SPLIT_PLAN, VOCAB, engine_loop, tiny_batch, tiny_model


def test_a_device_list_mixing_cpu_and_gpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="mixes CPU and GPU workers") as err:
        EngineConfig(devices=["cpu", "cuda:0"])
    assert err.value.field == "EngineConfig.devices"


def test_workers_sharing_a_gpu_divide_its_budget() -> None:
    gib = 1 << 30
    sizes = {0: 24 * gib, 1: 16 * gib}
    total = lambda d: sizes[d.index]  # noqa: E731
    one = [torch.device("cuda:0")]
    assert memory_budget(one, None, total_memory=total) == pytest.approx(GPU_MEMORY_SHARE * 24 * gib)
    three = [torch.device("cuda:0")] * 3
    assert memory_budget(three, None, total_memory=total) == pytest.approx(GPU_MEMORY_SHARE * 24 * gib / 3)
    # the smallest GPU bounds every stage; two workers listed on cuda:0 halve it
    mixed = [torch.device("cuda:0"), torch.device("cuda:0"), torch.device("cuda:1")]
    assert memory_budget(mixed, None, total_memory=total) == pytest.approx(GPU_MEMORY_SHARE * 16 * gib / 2)
    assert memory_budget(three, 1000, total_memory=total) == 1000.0  # a given budget is per stage


def test_memory_estimates_count_the_prefetch_and_the_logits_chunk() -> None:
    adapted = AdaptedModel(tiny_model("llama", blocks=2))
    host = HostState(adapted, compute_dtype=torch.float32, pin=False, double_buffer=False)
    tokens, chunk = 64, 16
    costs = memory_costs(
        host,
        microbatch_tokens=tokens,
        hidden_size=32,
        dtype_bytes=4,
        vocab_size=VOCAB,
        loss_chunk_tokens=chunk,
    )
    bare = memory_costs(host, microbatch_tokens=tokens, hidden_size=32, dtype_bytes=4)
    logits = chunk * VOCAB * (4 + 4 + 4)
    assert costs[-1].memory_backward - bare[-1].memory_backward == logits
    assert [c.memory_backward for c in costs[:-1]] == [c.memory_backward for c in bare[:-1]]
    # every layer reserves its weights twice: its own and the next stage's, prefetched
    block = host.param_bytes(1)
    act = tokens * 32 * 4
    assert costs[1].memory_forward == 2 * block + 2 * act
    # the chunk never exceeds the micro-batch
    small = memory_costs(host, microbatch_tokens=8, hidden_size=32, dtype_bytes=4, vocab_size=VOCAB)
    assert (
        small[-1].memory_backward
        - memory_costs(host, microbatch_tokens=8, hidden_size=32, dtype_bytes=4)[-1].memory_backward
        == 8 * VOCAB * 12
    )


def test_host_copies_are_carved_from_one_block_per_dtype() -> None:
    tensors = [torch.randn(3, 4), torch.randn(5), torch.arange(6), torch.randn(2, 2).to(torch.bfloat16)]
    views, blocks = HostState._blocks(tensors, pin=False)
    assert len(blocks) == 3  # float32, int64, bfloat16
    assert all(torch.equal(v, t) and v.dtype == t.dtype for v, t in zip(views, tensors, strict=True))
    floats = [v for v in views if v.dtype == torch.float32]
    assert floats[0].untyped_storage().data_ptr() == floats[1].untyped_storage().data_ptr()
    assert sum(b.numel() * b.element_size() for b in blocks) == sum(
        t.numel() * t.element_size() for t in tensors
    )
    assert DTYPES["bfloat16"] == torch.bfloat16


def test_a_prefetch_out_of_device_memory_falls_back_to_uploading_at_stage_start(monkeypatch) -> None:
    model = tiny_model("llama")
    batches = [tiny_batch(seed=s) for s in (1, 2)]
    config = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd", lr=0.1, partition=SPLIT_PLAN
    )
    _, want, _ = engine_loop(model, batches, config)
    allocate = Worker._allocate
    refused = []

    def tight(self, stage):
        if sys._getframe(1).f_code.co_name == "_start_prefetch":
            refused.append(stage.name)
            raise torch.OutOfMemoryError("no room for the next stage")
        return allocate(self, stage)

    monkeypatch.setattr(Worker, "_allocate", tight)
    _, got, _ = engine_loop(model, batches, config)
    assert refused  # the prefetch was tried and given up ...
    assert all(torch.equal(want[k], got[k]) for k in want)  # ... and the run is the same


def test_float16_that_never_recovers_fails_with_a_clear_error() -> None:
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.fill_(6e4)  # every logit overflows float16, whatever the loss scale
    config = EngineConfig(
        devices=["cpu"],
        num_microbatches=1,
        optimizer="sgd",
        lr=0.1,
        compute_dtype="float16",
        max_skipped_steps=3,
    )
    with (
        RoundPipe(copy.deepcopy(model), config) as rp,
        # every logit overflows: the loss itself is inf, which no loss scale mends (max_nonfinite_steps)
        pytest.raises(EngineError, match=r"3 steps in a row \(the last: step 3\) had a non-finite loss"),
    ):
        for _ in range(6):
            rp.forward_backward(**tiny_batch())
            rp.step()
            rp.synchronize()
    with pytest.raises(ConfigError, match="max_skipped_steps"):
        EngineConfig(max_skipped_steps=0)


def test_a_cancelled_iteration_keeps_no_worker_frames() -> None:
    """The frames of the stage that stopped hold its device tensors: they must not travel with
    the exception the caller receives."""
    model = tiny_model("llama")
    cancel = threading.Event()
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=3, partition=SPLIT_PLAN)
    with RoundPipe(copy.deepcopy(model), config, cancel=cancel) as rp:
        cancel.set()
        with pytest.raises(Cancelled) as err:
            rp.forward_backward(**tiny_batch())
    names = []
    tb = err.value.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert not {"_run_stage", "_backward", "_forward", "_check_cancel"} & set(names), names


def test_tf32_is_a_run_setting_on_by_default() -> None:
    config = TrainConfig.parse({"data": {"train": "train.jsonl"}})
    assert config.engine.tf32 is True
    assert TrainConfig.parse({"data": {"train": "t.jsonl"}, "engine": {"tf32": False}}).engine.tf32 is False
    # CPU workers compute in plain fp32 whatever the setting
    with RoundPipe(tiny_model("llama"), EngineConfig(devices=["cpu"])) as rp:
        assert rp.tf32 is False


def test_gpu_workers_build_masks_from_the_host_copy() -> None:
    """A device worker's masks and position ids are built on the host and copied up (the mask
    functions look at the mask's values); the device here is ``meta``, which holds no values."""
    adapted = AdaptedModel(tiny_model("qwen2"))  # a full and a sliding-window mask
    mask = tiny_batch()["attention_mask"]  # with padding
    want = adapted.build_context(adapted.rotary, torch.zeros(7, 12, 32), mask)
    sent: list[torch.Tensor] = []

    def upload(t: torch.Tensor) -> torch.Tensor:
        assert t.device.type == "cpu"
        sent.append(t)
        return t.to("meta")

    rotary = copy.deepcopy(adapted.rotary).to("meta")
    got = adapted.build_context(rotary, torch.empty(7, 12, 32, device="meta"), mask, upload)
    expected = [m for m in want.masks.values() if m is not None] + [want.position_ids]
    assert len(sent) == len(expected) >= 2
    assert all(torch.equal(a, b) for a, b in zip(sent, expected, strict=True))
    assert all(m is None or m.device.type == "meta" for m in got.masks.values())
    assert got.position_ids.device.type == "meta"


def test_modules_a_family_keeps_in_fp32_stay_fp32_in_a_bf16_run() -> None:
    model = tiny_model("gpt_oss")  # keeps its norms in fp32 (``_keep_in_fp32_modules``)
    host = HostState(AdaptedModel(model), compute_dtype=torch.bfloat16, pin=False, double_buffer=False)
    dtypes = {t.names[0]: t.compute.dtype for t in host.tensors if t.names}
    assert dtypes["model.norm.weight"] == torch.float32
    assert dtypes["model.layers.0.input_layernorm.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["lm_head.weight"] == torch.bfloat16
