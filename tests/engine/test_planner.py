"""The planner's memory figures against a real (tiny) model and engine; its advice when it does not fit."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.config import TrainConfig, resolve_compute_dtype
from engine.errors import ConfigError
from engine.planner import SEQ_LEN_STEP, Hardware, Shape, Workload, calibrate, plan_job
from tests.engine.tiny import FAMILIES, MOE_FAMILIES, tiny_batch, tiny_model

QWEN3_1_7B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
# Qwen3-30B-A3B's config.json: 128 experts of width 768, 8 active, every block sparse
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}


DENSE = [family for family in FAMILIES if family not in MOE_FAMILIES]
MOE = list(MOE_FAMILIES)
# Llama-3.1-8B's config.json (the sizes; 128k context)
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}


def config_of(model: torch.nn.Module) -> dict:
    """The model's config.json as the folder has it (``architectures`` included)."""
    return model.config.to_dict() | {"architectures": [type(model).__name__]}


@pytest.mark.parametrize("family", DENSE + MOE)
def test_parameter_counts_match_the_model_block_by_block(family: str) -> None:
    model = tiny_model(family)
    shape = Shape.from_config(config_of(model))
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.model.layers]
    assert [shape.block_params(b) for b in range(shape.layers)] == blocks
    assert sum(shape.layer_params()) == sum(p.numel() for p in model.parameters())  # a tied head once


@pytest.mark.parametrize("family", DENSE + MOE)
def test_a_family_s_block_kinds_are_the_model_s_linears_and_expert_stacks(family: str) -> None:
    model = tiny_model(family)
    shape = Shape.from_config(config_of(model))
    for b, block in enumerate(model.model.layers):
        kind = shape.block_kind(b)
        assert kind.name == ("experts" if shape.is_moe_block(b) else "dense")
        linears = {
            n: (m.in_features, m.out_features)
            for n, m in block.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
        assert kind.linears == linears, (family, b)
        stacks = {n: p.numel() for n, p in block.named_parameters() if p.dim() == 3}
        assert {n: e * i * o for n, (e, i, o) in kind.experts.items()} == stacks, (family, b)


def test_the_planner_reads_a_family_s_block_layout_from_its_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model.block_layout import FUSED_GATE_UP_MLP, FUSED_QKV_ATTENTION
    from engine.model.families import FAMILIES
    from engine.model.family_spec import FamilySpec

    house = FamilySpec(
        "HouseForCausalLM",
        model_type="house",
        attention=FUSED_QKV_ATTENTION,
        mlp=FUSED_GATE_UP_MLP,
        qkv_bias=True,
        block_extra=lambda s: s.heads,
    )
    monkeypatch.setitem(FAMILIES, "HouseForCausalLM", house)
    llama = Shape.from_config(LLAMA_3_8B)
    shape = Shape.from_config(LLAMA_3_8B | {"architectures": ["HouseForCausalLM"], "model_type": "house"})
    fused = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    assert set(shape.linears()) == fused
    # the fused projections hold what the separate ones do; q/k/v biases and the extra added
    q, kv = llama.heads * llama.head_dim, llama.kv_heads * llama.head_dim
    assert shape.block_params() == llama.block_params() + (q + 2 * kv) + llama.heads


@pytest.mark.parametrize("family", MOE)
def test_active_parameters_count_the_experts_a_token_visits(family: str) -> None:
    model = tiny_model(family)
    shape = Shape.from_config(config_of(model))
    moe = shape.moe
    assert moe is not None and shape.is_moe_block(shape.layers - 1)
    top = model.model.layers[-1].mlp
    per_expert = sum(p[0].numel() for n, p in top.experts.named_parameters())  # expert 0's slices
    inactive = (moe.experts - moe.active) * per_expert
    assert shape.active_block_params(shape.layers - 1) == shape.block_params(shape.layers - 1) - inactive
    for dense in moe.dense_blocks:  # every weight of a dense block is active
        assert shape.active_block_params(dense) == shape.block_params(dense)


@pytest.mark.parametrize("family", ["llama", "phi3", "glm4", *MOE])
@pytest.mark.parametrize(
    "targets", [None, ("q_proj", "v_proj", "o_proj"), ("o_proj",), ("gate_proj", "up_proj", "down_proj")]
)
def test_lora_trainable_count_matches_peft(family: str, targets: tuple[str, ...] | None) -> None:
    from peft import LoraConfig, get_peft_model

    from engine.model.families import family_for

    model = tiny_model(family)
    targets = targets or tuple(family_for(type(model).__name__).lora_targets)
    shape = Shape.from_config(config_of(model))
    try:
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    except ValueError:  # none of them in this family (Phi-3 has no q_proj): the run refuses it too
        return
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert shape.lora_params(4, targets) == trainable


@pytest.mark.parametrize("family", MOE)
def test_lora_on_expert_parameters_adds_rank_times_in_plus_out_per_expert(family: str) -> None:
    from peft import LoraConfig, get_peft_model

    model = tiny_model(family)
    shape = Shape.from_config(config_of(model))
    experts = ("experts.gate_up_proj", "experts.down_proj")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=list(experts))
    trainable = sum(p.numel() for p in get_peft_model(model, lora).parameters() if p.requires_grad)
    assert shape.lora_params(4, ("o_proj",), experts) == trainable
    moe = shape.moe
    assert moe is not None
    per_block = 4 * moe.experts * ((shape.hidden + 2 * moe.intermediate) + (moe.intermediate + shape.hidden))
    moe_blocks = shape.layers - len(moe.dense_blocks)
    assert trainable == shape.lora_params(4, ("o_proj",)) + moe_blocks * per_block


def test_host_optimizer_bytes_match_the_engine_after_a_step() -> None:
    model = tiny_model("llama")
    config = model.config.to_dict()
    with RoundPipe(copy.deepcopy(model), EngineConfig(devices=["cpu", "cpu"], num_microbatches=2)) as rp:
        rp.forward_backward(**tiny_batch(batch=4, seed=1))
        rp.step()
        rp.synchronize()
        measured = 0
        for t in rp.host.trainable:
            assert t.master is not None and t.master.grad is not None
            measured += t.master.numel() * t.master.element_size() + t.master.grad.numel() * 4
        # the optimizer state: one flat entry per unit, covering the unit's tensors
        for owner_opt in rp.optimizer.optimizers.values():
            for state in owner_opt.state.values():
                measured += sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")
        weights = sum(t.compute.numel() * t.compute.element_size() for t in rp.host.tensors)
    hardware = Hardware(num_gpus=2, gpu_memory_gb=24.0)
    report = plan_job(
        config,
        hardware,
        Workload(method="full", compute_dtype="float32", batch_size=4, num_microbatches=2, seq_len=16),
    )
    assert report.host_ram["optimizer_gb"] * 1e9 == pytest.approx(measured, rel=1e-9)
    assert report.host_ram["weights_gb"] * 1e9 == pytest.approx(weights, rel=1e-9)


def test_a_plan_that_fits_and_one_that_does_not() -> None:
    box = Hardware(num_gpus=4, gpu_memory_gb=24.0, host_ram_gb=128.0)
    ok = plan_job(QWEN3_1_7B, box, Workload(steps=1000))
    assert ok.fits and ok.problems == [] and ok.tokens_per_s > 0
    assert ok.eta_s == pytest.approx(1000 * ok.iteration_s)
    assert all(s["gpu_memory_gb"] <= 24.0 for s in ok.stages)
    assert 0 <= ok.bubble < 1
    # async: iterations overlap without a flush, so the period is shorter than a sync iteration
    overlapped = plan_job(QWEN3_1_7B, box, Workload(steps=1000, async_optimizer=True))
    assert overlapped.iteration_s < ok.iteration_s
    # a full fine-tune of a 1.7B model needs ~28 GB of optimizer state: not on a 16 GB host
    small_host = plan_job(QWEN3_1_7B, Hardware(num_gpus=4, host_ram_gb=16.0), Workload(method="full"))
    assert not small_host.fits and "host RAM" in small_host.problems[0]
    assert any("LoRA" in s for s in small_host.suggestions)
    # one micro-batch of 512k tokens: one block's activations alone do not fit a 24 GB GPU
    long = plan_job(QWEN3_1_7B, box, Workload(seq_len=262144, batch_size=2, num_microbatches=1))
    assert not long.fits and "micro-batch" in long.problems[0]
    assert f"seq_len {long.max_seq_len} or shorter" in long.suggestions[0]


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_microbatches=9 exceeds batch_size=4"):
        plan_job(QWEN3_1_7B, Hardware(), Workload(batch_size=4, num_microbatches=9))
    with pytest.raises(ValueError, match="hidden_size"):
        plan_job({"num_hidden_layers": 2}, Hardware(), Workload())
    with pytest.raises(ValueError, match="efficiency"):
        plan_job(QWEN3_1_7B, Hardware(efficiency=0.0), Workload())


def test_calibration_scales_the_rate_to_the_measurement() -> None:
    box = Hardware(num_gpus=2)
    before = plan_job(QWEN3_1_7B, box, Workload())
    tuned = calibrate(
        box, predicted_tokens_per_s=before.tokens_per_s, measured_tokens_per_s=before.tokens_per_s / 2
    )
    after = plan_job(QWEN3_1_7B, tuned, Workload())
    assert tuned.efficiency == pytest.approx(box.efficiency / 2)
    # compute dominates: half the rate gives about half the throughput (uploads do not scale)
    assert after.tokens_per_s == pytest.approx(before.tokens_per_s / 2, rel=0.15)
    assert torch.isfinite(torch.tensor(after.iteration_s))


def test_workload_from_train_config_maps_every_field() -> None:
    config = TrainConfig.parse(
        {
            "data": {"train": "train.jsonl", "max_length": 512},
            "method": {"kind": "full", "lora_r": 4, "target_modules": ["q_proj", "v_proj"]},
            "hyper": {"max_steps": 300, "batch_size": 12},
            "engine": {"num_microbatches": 6, "async_optimizer": True, "compute_dtype": "float16"},
        }
    )
    assert Workload.from_train_config(config) == Workload(
        seq_len=512,
        batch_size=12,
        method="full",
        lora_r=4,
        target_modules=("q_proj", "v_proj"),
        num_microbatches=6,
        compute_dtype="float16",
        async_optimizer=True,
        steps=300,
    )
    # max_steps wins over a row count; "auto" is the engine's rule (resolve_compute_dtype)
    assert Workload.from_train_config(config, num_sequences=10**6).steps == 300
    auto = config.model_copy(update={"engine": config.engine.model_copy(update={"compute_dtype": "auto"})})
    for on_gpu in (True, False):
        dtype = Workload.from_train_config(auto, on_gpu=on_gpu).compute_dtype
        assert dtype == resolve_compute_dtype("auto", on_gpu=on_gpu)
    assert Workload.from_train_config(auto).compute_dtype == "bfloat16"  # the planner plans GPUs


def test_workload_steps_from_epochs_count_whole_batches_like_the_run() -> None:
    config = TrainConfig.parse({"data": {"train": "t.jsonl"}, "hyper": {"epochs": 1.5, "batch_size": 8}})
    assert Workload.from_train_config(config).steps is None  # rows unknown
    assert Workload.from_train_config(config, num_sequences=100).steps == 18  # ceil(1.5 * (100 // 8))
    assert Workload.from_train_config(config, num_sequences=5).steps == 1  # less than one batch


def test_numbers_out_of_range_raise_config_error_not_arithmetic_errors() -> None:
    from engine.errors import ConfigError
    from engine.planner import HARDWARE_RANGES

    for bad, field in (
        (Hardware(gpu_memory_gb=5e-324, gpu_tflops=5e-324, efficiency=5e-324), "gpu_memory_gb"),
        (Hardware(link_gb_s=1e-300), "link_gb_s"),
        (Hardware(efficiency=5e-324), "efficiency"),
        (Hardware(gpu_tflops=float("inf")), "gpu_tflops"),
        (Hardware(gpu_memory_gb=float("nan")), "gpu_memory_gb"),
        (Hardware(host_ram_gb=0.0), "host_ram_gb"),
        (Hardware(num_gpus=65), "num_gpus"),
    ):
        with pytest.raises(ConfigError) as info:
            plan_job(QWEN3_1_7B, bad, Workload())
        assert info.value.field == field
    for key, value in (
        ("hidden_size", 10**400),
        ("num_hidden_layers", 10**6),
        ("head_dim", "x"),
        ("num_key_value_heads", 2.5),
        ("vocab_size", True),
    ):
        with pytest.raises(ConfigError) as info:
            plan_job(QWEN3_1_7B | {key: value}, Hardware(), Workload())
        assert info.value.field == key
    with pytest.raises(ConfigError, match="text_config"):
        Shape.from_config({"text_config": [1]})
    with pytest.raises(ConfigError, match="seq_len"):
        plan_job(QWEN3_1_7B, Hardware(), Workload(seq_len=2**40))
    # a measurement far below the prediction: the efficiency stays at the bottom of its range
    tuned = calibrate(Hardware(), predicted_tokens_per_s=1e9, measured_tokens_per_s=1.0)
    assert tuned.efficiency == HARDWARE_RANGES["efficiency"][0]
    assert plan_job(QWEN3_1_7B, tuned, Workload()).tokens_per_s > 0


def test_the_longest_sequence_that_fits_llama_3_8b_on_one_24_gb_gpu() -> None:
    job = Workload(seq_len=2048, batch_size=1, num_microbatches=1, lora_r=16, compute_dtype="bfloat16")
    report = plan_job(LLAMA_3_8B, Hardware(num_gpus=1, gpu_memory_gb=24.0), job)
    assert (report.max_seq_len, report.max_seq_len_limit) == (69632, "gpu_memory")
    assert plan_job(LLAMA_3_8B, Hardware(num_gpus=1, gpu_memory_gb=24.0), replace(job, seq_len=69632)).fits
    assert not plan_job(
        LLAMA_3_8B, Hardware(num_gpus=1, gpu_memory_gb=24.0), replace(job, seq_len=69696)
    ).fits


@pytest.mark.parametrize(
    ("config", "job"),
    [
        (LLAMA_3_8B, Workload(batch_size=1, num_microbatches=1)),
        (LLAMA_3_8B, Workload(batch_size=8, num_microbatches=2, method="full", compute_dtype="float16")),
        (QWEN3_1_7B, Workload(batch_size=4, num_microbatches=4, devices=("cuda:0", "cuda:0"))),
        (QWEN3_30B_A3B, Workload(batch_size=16, num_microbatches=1)),
    ],
)
def test_the_longest_sequence_grows_with_memory_and_is_the_edge_of_the_fit(
    config: dict, job: Workload
) -> None:
    longest = []
    for gb in (12.0, 16.0, 24.0, 32.0, 48.0, 80.0):
        box = Hardware(num_gpus=2, gpu_memory_gb=gb)
        report = plan_job(config, box, job)
        longest.append(report.max_seq_len)
        if report.max_seq_len_limit == "gpu_memory" and report.max_seq_len:
            assert plan_job(config, box, replace(job, seq_len=report.max_seq_len)).fits
            assert not plan_job(config, box, replace(job, seq_len=report.max_seq_len + SEQ_LEN_STEP)).fits
    assert longest == sorted(longest) and longest[-1] > longest[0]


def test_the_host_ram_can_be_what_limits_the_sequence() -> None:
    box = Hardware(num_gpus=8, gpu_memory_gb=80.0, host_ram_gb=24.0)
    job = Workload(batch_size=64, num_microbatches=64)
    report = plan_job(QWEN3_1_7B, box, job)
    assert report.max_seq_len_limit == "host_ram" and report.max_seq_len > 0
    assert plan_job(QWEN3_1_7B, box, replace(job, seq_len=report.max_seq_len)).fits
    over = plan_job(QWEN3_1_7B, box, replace(job, seq_len=report.max_seq_len + SEQ_LEN_STEP))
    assert not over.fits and "host RAM" in over.problems[0]


@pytest.mark.parametrize("ram", [128.0, 512.0])
def test_the_host_ram_edge_of_a_model_of_256_blocks(ram: float) -> None:
    deep = LLAMA_3_8B | {"num_hidden_layers": 256}
    box = Hardware(num_gpus=8, gpu_memory_gb=24.0, host_ram_gb=ram)
    job = Workload(batch_size=16, num_microbatches=16)
    report = plan_job(deep, box, job)
    assert report.max_seq_len_limit == "host_ram"
    if report.max_seq_len:
        assert plan_job(deep, box, replace(job, seq_len=report.max_seq_len)).fits
    assert not plan_job(deep, box, replace(job, seq_len=report.max_seq_len + SEQ_LEN_STEP)).fits


def test_workers_sharing_a_gpu_divide_its_memory() -> None:
    box = Hardware(num_gpus=1, gpu_memory_gb=24.0)
    alone = plan_job(QWEN3_1_7B, box, Workload(batch_size=2, num_microbatches=2, devices=("cuda:0",)))
    shared = plan_job(QWEN3_1_7B, box, Workload(batch_size=2, num_microbatches=2, devices=("cuda:0",) * 2))
    assert shared.workers_per_gpu == 2 and shared.fits
    assert shared.max_seq_len < alone.max_seq_len
    assert all(s["gpu_memory_gb"] <= 12.0 for s in shared.stages)  # each worker within half the GPU
    assert shared.gpu_memory_needed_gb <= 24.0


def test_stage_memory_terms_add_up_and_the_logits_are_one_chunk() -> None:
    from engine.planner import CUDA_OVERHEAD_BYTES, GB

    job = Workload(seq_len=16384, batch_size=1, num_microbatches=1)
    report = plan_job(LLAMA_3_8B, Hardware(num_gpus=2, gpu_memory_gb=48.0), job)
    fused = next(s for s in report.stages if s["kind"] == "fused")
    terms = fused["memory_gb"]
    assert terms["total"] == pytest.approx(sum(v for k, v in terms.items() if k != "total"))
    assert fused["gpu_memory_gb"] == pytest.approx(terms["total"] + CUDA_OVERHEAD_BYTES / GB)
    # [2048, vocab] (the default chunk) in fp32 and its gradient, and the bf16 head output; not
    # [16384, vocab]
    assert terms["logits"] * GB == pytest.approx(2048 * 128256 * (4 + 4 + 2))
    chunked = plan_job(
        LLAMA_3_8B, Hardware(num_gpus=2, gpu_memory_gb=48.0), replace(job, loss_chunk_tokens=512)
    )
    assert (
        next(s for s in chunked.stages if s["kind"] == "fused")["memory_gb"]["logits"] == terms["logits"] / 4
    )
    assert all(s["memory_gb"]["logits"] == 0 for s in report.stages if s["kind"] != "fused")
    assert all(s["memory_gb"]["activations"] == 0 for s in report.stages if s["kind"] == "forward")


def test_moe_uploads_every_expert_but_computes_with_the_active_ones() -> None:
    dense_twin = QWEN3_30B_A3B | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    moe = plan_job(QWEN3_30B_A3B, Hardware(num_gpus=4, gpu_memory_gb=24.0), Workload())
    shape = Shape.from_config(QWEN3_30B_A3B)
    assert moe.parameters == sum(shape.layer_params())
    assert 30e9 < moe.parameters < 31e9  # every expert's weights in host RAM
    # every expert's weights and the LoRA adapters, in bf16
    assert moe.host_ram["weights_gb"] == pytest.approx((moe.parameters + moe.trainable) * 2 / 1e9)
    active = sum(shape.active_block_params(b) for b in range(shape.layers))
    assert 2.5e9 < active + 2 * shape.vocab * shape.hidden < 3.5e9  # "A3B"
    assert Shape.from_config(dense_twin).moe is None


def test_memory_terms_agree_with_the_engines_estimate() -> None:
    from engine.parallel.stages import ACTIVATIONS_PER_BLOCK_BACKWARD, memory_costs
    from engine.planner import Memory, memory_model

    model = tiny_model("llama")
    tokens, vocab, chunk = 64, model.config.vocab_size, 16
    with RoundPipe(copy.deepcopy(model), EngineConfig(devices=["cpu"], num_microbatches=1)) as rp:
        host = rp.host
        weights = [float(host.param_bytes(i)) for i in range(host.num_layers)]
        trainable = [host.trainable_numel(i) for i in range(host.num_layers)]
        sizes = {"microbatch_tokens": tokens, "hidden_size": 32, "dtype_bytes": 4, "loss_chunk_tokens": chunk}
        head = memory_costs(host, vocab_size=vocab, **sizes)[-1]
        headless = memory_costs(host, vocab_size=0, **sizes)[-1]
    job = Workload(method="full", compute_dtype="float32", seq_len=tokens, batch_size=1, num_microbatches=1)
    memory: Memory = memory_model(
        Shape.from_config(config_of(model)), replace(job, loss_chunk_tokens=chunk), Hardware(), trainable
    )
    assert memory.weights == weights  # the upload: the compute copy of every layer
    # the output layer's one chunk of logits
    assert memory.logits[-1] == head.memory_backward - headless.memory_backward == chunk * vocab * 12
    # a block's saved activations: about the engine's count of hidden-sized tensors a token
    per_token = memory.activations[1] / tokens / 4 / 32
    assert abs(per_token - ACTIVATIONS_PER_BLOCK_BACKWARD) <= 4
    assert memory.gradients == [4.0 * n for n in trainable]  # fp32: one buffer, accumulated in place


def test_bad_mixture_of_experts_sizes_name_the_field() -> None:
    from engine.errors import ConfigError

    for key, value, field in (
        ("num_experts", 0, "experts"),
        ("num_experts_per_tok", 129, "active_experts"),
        ("moe_intermediate_size", None, "expert_intermediate"),
        ("mlp_only_layers", 5, "architectures"),
    ):
        with pytest.raises(ConfigError) as info:
            Shape.from_config(QWEN3_30B_A3B | {key: value})
        assert info.value.field == field, (key, info.value)


def test_a_dpo_plan_is_the_lora_plan_of_twice_the_batch_plus_the_reference_pass() -> None:
    box = Hardware(num_gpus=4, gpu_memory_gb=24.0, host_ram_gb=128.0)
    dpo_job = Workload(method="dpo", batch_size=8, num_microbatches=4, steps=100, reference_pairs=800)
    dpo = plan_job(QWEN3_1_7B, box, dpo_job)
    lora = plan_job(QWEN3_1_7B, box, Workload(batch_size=16, num_microbatches=4, steps=100))
    # each step trains 2 sequences a pair: the LoRA step of twice the batch, time and memory alike
    assert dpo.fits and dpo.assumptions["sequences_per_step"] == 16
    assert dpo.iteration_s == lora.iteration_s and dpo.tokens_per_s == lora.tokens_per_s
    assert dpo.stages == lora.stages and dpo.host_ram == lora.host_ram
    assert (dpo.max_seq_len, dpo.trainable) == (lora.max_seq_len, lora.trainable)
    # against the LoRA plan of the same batch: a micro-batch holds twice the sequences
    same = plan_job(QWEN3_1_7B, box, Workload(batch_size=8, num_microbatches=4, steps=100))
    assert same.reference_s is None and same.eta_s == pytest.approx(100 * same.iteration_s)
    for d, s in zip(dpo.stages, same.stages, strict=True):
        assert d["memory_gb"]["activations"] == pytest.approx(2 * s["memory_gb"]["activations"])
    assert dpo.iteration_s > same.iteration_s and dpo.max_seq_len < same.max_seq_len
    # the reference pass: one forward over every pair, once, in the ETA; less than a step per batch
    assert dpo.reference_s is not None and dpo.reference_s > 0
    assert dpo.eta_s == pytest.approx(100 * dpo.iteration_s + dpo.reference_s)
    assert dpo.reference_s / (800 / 8) < dpo.iteration_s
    for pairs in (8, 80, 1600):
        other = plan_job(QWEN3_1_7B, box, replace(dpo_job, reference_pairs=pairs)).reference_s
        assert other == pytest.approx(dpo.reference_s * pairs / 800, rel=1e-9)
    ragged = plan_job(QWEN3_1_7B, box, replace(dpo_job, reference_pairs=804)).reference_s
    assert ragged is not None and dpo.reference_s < ragged < dpo.reference_s * 808 / 800  # a short batch
    assert plan_job(QWEN3_1_7B, box, replace(dpo_job, reference_pairs=0)).reference_s == 0.0
    unknown = plan_job(QWEN3_1_7B, box, replace(dpo_job, reference_pairs=None))
    assert unknown.reference_s is None and "pair count is unknown" in unknown.describe()
    assert "reference pass over 800 pairs" in dpo.describe()
    # DPO of every weight: the full fine-tune's step; its reference, the initial weights' forward
    # through the full plan's stages (which differ from the LoRA plan's)
    full_dpo = plan_job(QWEN3_1_7B, box, replace(dpo_job, dpo_tuning="full"))
    full = plan_job(QWEN3_1_7B, box, Workload(method="full", batch_size=16, num_microbatches=4, steps=100))
    assert full_dpo.iteration_s == full.iteration_s and full_dpo.trainable == full.trainable
    assert full_dpo.stages == full.stages and full_dpo.host_ram == full.host_ram
    assert full_dpo.reference_s is not None and 0 < full_dpo.reference_s / 100 < full_dpo.iteration_s
    with pytest.raises(ValueError, match="dpo_tuning='adapter'"):
        plan_job(QWEN3_1_7B, box, replace(dpo_job, dpo_tuning="adapter"))
    with pytest.raises(ValueError, match="reference_pairs=-1"):
        plan_job(QWEN3_1_7B, box, replace(dpo_job, reference_pairs=-1))


def test_workload_of_a_dpo_run_counts_pairs() -> None:
    config = TrainConfig.parse(
        {
            "data": {"train": "t.jsonl", "max_length": 256},
            "method": {"kind": "dpo", "dpo_tuning": "full", "beta": 0.5},
            "hyper": {"batch_size": 4, "epochs": 2},
            "engine": {"num_microbatches": 2},
        }
    )
    w = Workload.from_train_config(config, num_sequences=10, num_validation=3)
    assert (w.method, w.dpo_tuning, w.tuning, w.sequences) == ("dpo", "full", "full", 8)
    assert w.steps == 4 and w.reference_pairs == 13  # whole batches of pairs; training and validation
    assert Workload.from_train_config(config).reference_pairs is None
    # token counts list each pair's chosen and rejected sequence: batched as pairs
    lengths = [10, 30] * 8
    w = Workload.from_train_config(config, num_sequences=8, token_lengths=lengths)
    assert w.mean_seq_len == 30.0  # every batch padded to its longest row, a rejected one
    # the config refuses packing pairs (the method's check), so no such workload is ever built
    with pytest.raises(ValueError, match=r"data\.packing"):
        TrainConfig.parse({**config.model_dump(), "data": {**config.data.model_dump(), "packing": True}})


def test_workload_of_a_grpo_run_counts_prompts_times_their_group() -> None:
    grader = {"type": "string_check", "name": "x", "input": "{{sample.output_text}}", "reference": "a"}
    raw = {
        "data": {"train": "t.jsonl", "max_length": 128},
        "method": {"objective": "grpo", "grader": grader | {"operation": "eq"}, "group_size": 8},
        "hyper": {"batch_size": 4, "epochs": 1},
        "engine": {"num_microbatches": 2},
    }
    raw["method"]["max_completion_tokens"] = 32
    config = TrainConfig.parse(raw)
    w = Workload.from_train_config(config, num_sequences=10)
    assert (w.method, w.sequences_per_example, w.sequences, w.steps) == ("grpo", 8, 32, 2)
    assert w.samples and w.completion_tokens == 32 and not w.kl_reference  # GRPO's beta: 0 by default
    raw["method"]["beta"] = 0.1  # a KL term: the base model's log-probabilities each step
    assert Workload.from_train_config(TrainConfig.parse(raw), num_sequences=10).kl_reference
    del raw["method"]["beta"]
    # the prompts' lengths, cut to leave room for the completion, each followed by a whole one
    lengths = [10, 200, 30, 40]
    w = Workload.from_train_config(config, num_sequences=4, token_lengths=lengths)
    assert w.mean_prompt_len == 96.0 and w.mean_seq_len == 128.0  # one batch, padded to its longest
    w = Workload.from_train_config(config, num_sequences=4, token_lengths=[10, 20, 30, 40])
    assert (w.mean_prompt_len, w.mean_seq_len) == (40.0, 72.0)
    # the run's refusals, which the config itself makes (GRPO's check): packing, and a completion
    # that leaves the prompt no room
    with pytest.raises(ConfigError, match=r"data\.packing=true"):
        TrainConfig.parse(raw | {"data": raw["data"] | {"packing": True}})
    with pytest.raises(ConfigError) as info:
        TrainConfig.parse(raw | {"method": raw["method"] | {"max_completion_tokens": 128}})
    assert info.value.field == "method.max_completion_tokens"
    # a step: its training iteration, then its rollouts; other methods have none
    box = Hardware(num_gpus=2, gpu_memory_gb=24.0)
    grpo = plan_job(QWEN3_1_7B, box, Workload.from_train_config(config, num_sequences=10))
    assert grpo.rollout is not None and grpo.rollout_s is not None and grpo.rollout_s > 0
    assert grpo.step_s == pytest.approx(grpo.iteration_s + grpo.rollout_s)
    assert grpo.eta_s == pytest.approx(2 * grpo.step_s) and "GRPO: 32 completions" in grpo.describe()
    lora = plan_job(QWEN3_1_7B, box, Workload(batch_size=4, num_microbatches=2, steps=2))
    assert lora.rollout is None and lora.rollout_s is None and lora.step_s == lora.iteration_s
