"""A 4-bit base (NF4, ``base_bits=4``): the packed format decodes as torchao decodes it, and the
engine trains a LoRA adapter on it exactly like a plain loop on the dequantized base."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.errors import ConfigError
from engine.model import quant
from tests.engine.tiny import SPLIT_PLAN, bitwise_equal, engine_loop, max_diff, plain_loop, tiny_model

TOL = 1e-5


def test_the_packed_buffer_decodes_as_torchao_decodes_its_nf4_tensor() -> None:
    nf4_cls, _ = quant._nf4()
    g = torch.Generator().manual_seed(0)
    for shape in ((64, 128), (4, 96, 64), (256, 512)):
        w = torch.randn(shape, generator=g)
        buffer, layout = quant.pack(w, torch.float32)
        assert buffer.dtype == torch.uint8 and buffer.numel() == quant.packed_bytes(w.numel(), 4)
        # fp32 distances: the codes are torchao's own, so is every decoded value
        ref = nf4_cls.from_tensor(w.reshape(-1, shape[-1]), quant.BLOCK, quant.scaler_block(w.numel()))
        assert torch.equal(layout.unpack(buffer), ref.get_original_weight().reshape(shape))
        # NF4's error: at most half the widest gap between codes, times the block's absmax
        blocks = w.reshape(-1, quant.BLOCK)
        err = (layout.unpack(buffer).reshape(-1, quant.BLOCK) - blocks).abs()
        assert (err <= 0.16 * blocks.abs().amax(dim=1, keepdim=True) + 1e-2).all()
    # bfloat16: decoded bit for bit as torchao decodes the same codes and scales
    _, meta = quant._nf4()
    for shape in ((4, 96, 64), (512, 256)):
        buffer, layout = quant.pack(torch.randn(shape, generator=g), torch.bfloat16)
        codes, scales, factors, mean, book = layout._views(buffer)
        matrix = torch.Size((layout.numel // shape[-1], shape[-1]))
        theirs = nf4_cls(
            meta(matrix, (shape[-1], 1), 0, torch.bfloat16, buffer.device, False),
            quant.BLOCK,
            layout.numel // quant.BLOCK,
            layout.scaler_block,
            scales,
            factors,
            mean.reshape(()),
            codes,
            book,
        )
        assert torch.equal(layout.unpack(buffer), theirs.get_original_weight().reshape(shape))
    # bfloat16 constants: about 4.13 bits a value, against 16
    assert quant.packed_bytes(4096 * 4096, 2) / (4096 * 4096 * 2) < 0.26


def _lora(family: str) -> torch.nn.Module:
    return lora_of(tiny_model(family))


def lora_of(base: torch.nn.Module, seed: int | None = None) -> torch.nn.Module:
    """LoRA r4 on the family's default targets (its A matrices drawn after ``manual_seed(seed)``
    when given), its B matrices non-zero (so the adapter changes the output from the first step)."""
    from peft import LoraConfig, get_peft_model

    from engine.model.families import family_for

    spec = family_for(type(base).__name__)
    if seed is not None:
        torch.manual_seed(seed)
    lora = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(spec.lora_targets))
    )
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return lora


def _packed_names(model: torch.nn.Module) -> set[str]:
    rp = RoundPipe(copy.deepcopy(model), EngineConfig(base_bits=4))
    try:
        return {n for t in rp.host.tensors if t.packed is not None for n in t.names}
    finally:
        rp.close()


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_lora_on_a_4bit_base_equals_the_plain_loop_on_the_dequantized_base(family: str, batches) -> None:
    lora = _lora(family)
    packed = _packed_names(lora)
    frozen = {n for n, p in lora.named_parameters() if not p.requires_grad}
    # the blocks' frozen matrices (linear and expert weights) and nothing else: no norm,
    # embedding, LM head, router or adapter
    assert packed and packed <= frozen
    for name, p in lora.named_parameters():
        block = ".layers." in name
        router = name.endswith("mlp.gate.weight")
        if not p.requires_grad and block and p.dim() >= 2 and not router:
            assert name in packed, name
        if name in packed:
            assert block and p.dim() >= 2 and not router, name
    if family == "qwen3_moe":
        assert any(".experts." in n for n in packed)
    # the reference: the same model with those weights replaced by their decoded values
    reference = copy.deepcopy(lora)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name in packed:
                p.copy_(quant.dequantized(p, torch.float32))
    ref_losses, ref_state = plain_loop(reference, batches, sgd)
    results = []
    for workers, plan in ((1, None), (3, SPLIT_PLAN)):
        config = EngineConfig(
            devices=["cpu"] * workers,
            num_microbatches=3,
            optimizer="sgd",
            lr=0.1,
            partition=plan,
            base_bits=4,
        )
        losses, state, _ = engine_loop(lora, batches, config)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOL
        assert max_diff(state, ref_state) < TOL
        results.append((losses, state))
    assert results[0][0] == results[1][0] and bitwise_equal(results[0][1], results[1][1])
    # the base really was quantized: the 16-bit base's loss differs
    plain_losses, _ = plain_loop(lora, batches[:1], sgd)
    assert abs(plain_losses[0] - ref_losses[0]) > 1e-4


def test_a_4bit_base_packs_the_host_copy_and_is_refused_without_a_frozen_base() -> None:
    lora = _lora("llama")
    dense = RoundPipe(copy.deepcopy(lora), EngineConfig())
    packed = RoundPipe(copy.deepcopy(lora), EngineConfig(base_bits=4))
    try:
        by_name = {n: t for t in dense.host.tensors for n in t.names}
        base = [t for t in packed.host.tensors if t.packed is not None]
        before = sum(by_name[t.names[0]].compute.nbytes for t in base)
        after = sum(t.compute.nbytes for t in base)
        # fp32 here: NF4 with fp32 constants is about 1/7 of it (with the tiny tensors' padding)
        assert after < 0.2 * before, (after, before)
        # what a stage uploads shrinks by as much (the uploads are the host copies)
        assert packed.host.param_bytes(1) == dense.host.param_bytes(1) - sum(
            by_name[t.names[0]].compute.nbytes - t.compute.nbytes for t in base if t.owner == 1
        )
    finally:
        dense.close()
        packed.close()
    with pytest.raises(ConfigError, match="base_bits"):
        RoundPipe(tiny_model("llama"), EngineConfig(base_bits=4))
    with pytest.raises(ConfigError, match="base_bits"):
        EngineConfig(base_bits=8)
