"""The planner's measured activation table: fresh saved-tensor measurements agree with it, and the
planner's and the engine's per-block activations are what a block really keeps."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.model.activations import (
    DTYPES,
    MEASURED,
    block_saved_bytes,
    family_rows,
    fit,
    measure,
    small_config,
)
from engine.planner import Hardware, Shape, Workload, memory_model
from engine.planner.activation_table import TABLE
from engine.planner.activations import block_bytes_per_token, features, model_shape

CHECKED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# a shape none of the fits saw: 4x the tiny hidden size, head_dim 32, MoE 8 experts of width 88
MEDIUM = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "experts": 8,
    "active_experts": 2,
    "moe_intermediate_size": 88,
}
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


def test_the_table_covers_every_measured_family_and_dtype() -> None:
    assert set(TABLE) == set(MEASURED)
    assert all(set(rows) == set(DTYPES) for rows in TABLE.values())


@pytest.mark.parametrize("architecture", CHECKED)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_table_matches_a_fresh_measurement(architecture: str, dtype: str) -> None:
    """Re-measure the fitted shapes: the committed coefficients still give every block's bytes
    (regenerate with ``python -m engine.model.activations`` when this fails)."""
    rows = family_rows(architecture, dtype)
    for shape, block, measured in rows:
        predicted = block_bytes_per_token(shape, block, dtype)
        assert predicted == pytest.approx(measured, rel=0.01), (architecture, dtype, block, shape)
    # and a fresh fit extrapolates like the table to a real size (a 1B Llama's widths)
    fresh = fit(rows)
    moe = {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
    big = Shape.from_config(LLAMA_1B | moe | {"architectures": [architecture], "head_dim": 64})
    for block in range(2):
        f = features(big, block)
        assert sum(c * f[k] for k, c in fresh.items()) == pytest.approx(
            block_bytes_per_token(big, block, dtype), rel=0.01
        )


@pytest.mark.parametrize("architecture", CHECKED)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_planner_predicts_what_a_block_keeps(architecture: str, dtype: str) -> None:
    """On a shape no fit saw, the planner's activation term of every block is within 10% of the
    bytes autograd keeps (it is within 1%: the block is linear in its widths)."""
    config = small_config(architecture, **MEDIUM)
    rows = measure(config, architecture, dtype)
    shape = rows[0][0]
    tokens = 256
    job = Workload(method="full", compute_dtype=dtype, seq_len=tokens, batch_size=1, num_microbatches=1)
    memory = memory_model(shape, job, Hardware(), shape.layer_params())
    for _, block, measured in rows:
        assert memory.activations[block + 1] / tokens == pytest.approx(measured, rel=0.10)


def test_the_engines_memory_costs_count_the_same_activations() -> None:
    import copy

    from engine import EngineConfig, RoundPipe
    from engine.parallel.stages import ACTIVATIONS_PER_BLOCK_BACKWARD, memory_costs
    from tests.engine.tiny import tiny_model

    model = tiny_model("qwen3_moe")
    tokens = 64
    shape = model_shape(model.config, type(model).__name__)
    assert shape is not None
    job = Workload(method="full", compute_dtype="float32", seq_len=tokens, batch_size=1, num_microbatches=1)
    with RoundPipe(copy.deepcopy(model), EngineConfig(devices=["cpu"], num_microbatches=1)) as rp:
        sizes = {"microbatch_tokens": tokens, "hidden_size": shape.hidden, "dtype_bytes": 4}
        measured = memory_costs(rp.host, shape=shape, **sizes)
        old = memory_costs(rp.host, **sizes)
        memory = memory_model(shape, job, Hardware(), [rp.host.trainable_numel(i) for i in range(5)])
    for i in range(1, 4):  # the blocks: the planner's activations; the other layers as before
        assert measured[i].memory_backward - old[i].memory_backward == pytest.approx(
            memory.activations[i] - tokens * shape.hidden * 4 * ACTIVATIONS_PER_BLOCK_BACKWARD
        )
    assert measured[0] == old[0] and measured[-1] == old[-1]
    # a family the table lacks keeps the old estimate
    lacking = model_shape(tiny_model("deepseek_v3").config, "DeepseekV3ForCausalLM")
    assert lacking is not None and block_bytes_per_token(lacking, 1, "bfloat16") is None


def test_a_bf16_llama_1b_block_keeps_26_and_a_half_hidden_tensors() -> None:
    """The issue's shape: a bf16 Llama-3.2-1B block keeps ~26.5 hidden-sized tensors a token,
    not the 16 the engine assumed (norm inputs in fp32, four MLP-wide tensors)."""
    shape = Shape.from_config(LLAMA_1B)
    per_token = block_bytes_per_token(shape, 0, "bfloat16")
    assert per_token is not None
    assert per_token / (2 * shape.hidden) == pytest.approx(26.5, abs=0.05)


def test_the_saved_bytes_leave_out_the_weights_and_the_context() -> None:
    """A block's weights count once as weights, not again as activations."""
    import torch
    import transformers

    from engine.model.adapter import AdaptedModel

    config = small_config("LlamaForCausalLM")
    model = transformers.LlamaForCausalLM(config)
    adapted = AdaptedModel(model)
    x = torch.randn(1, 8, config.hidden_size, requires_grad=True)
    layer = adapted.layers[1]
    weights = sum(t.numel() * t.element_size() for t in layer.tensors.values())
    saved = block_saved_bytes(adapted, layer, x)
    assert 0 < saved < weights  # 8 tokens keep far less than the block's weights


def test_the_planner_reads_the_table_without_torch() -> None:
    code = "import sys, engine.planner, engine.planner.activations\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
