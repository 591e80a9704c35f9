"""The correctness contract for vision-language models: RoundPipe trains a VLM exactly like a
plain PyTorch loop over the unsplit model (its own forward, the whole batch, one device), for
each family, with the vision tower and projector trained or frozen, images of different sizes in
one batch, a text row among them, and the same bits for any worker count and partition."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig
from tests.engine.tiny import bitwise_equal, engine_loop
from tests.engine.tiny_vision import ENGINE_VLM_FAMILIES, tiny_processor, tiny_vlm, vision_batches

STEPS = 3
TOL = 1e-5


def plain(
    model: torch.nn.Module, batch: dict, lr: float = 0.1
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD on the model's own forward (mean loss over the batch's label tokens)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(STEPS):
        loss = ref(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().float().clone() for k, v in ref.state_dict().items()}


def far(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[tuple[str, float]]:
    """The tensors further than ``TOL`` from the reference, relative to their size where it
    exceeds 1 (Gemma 3's projector matrix grows to ~240 in 3 steps: float32 keeps ~7 digits)."""
    assert set(state) == set(ref)
    out = []
    for k in ref:
        scale = max(1.0, ref[k].abs().max().item())
        d = (state[k].float() - ref[k]).abs().max().item()
        if d > TOL * scale:
            out.append((k, d))
    return out


def frozen_tower(model: torch.nn.Module) -> torch.nn.Module:
    from engine.vision.families import VISION_FAMILIES

    spec = VISION_FAMILIES[type(model).__name__]
    model = copy.deepcopy(model)
    for name, p in model.named_parameters():
        if name.startswith(spec.tower + ".") or name.startswith(spec.projector + "."):
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("tower", ["trained", "frozen"])
@pytest.mark.parametrize("family", ENGINE_VLM_FAMILIES)
def test_vlm_equals_the_plain_loop_for_1_to_3_workers_bitwise_across_them(family: str, tower: str) -> None:
    model = tiny_vlm(family)
    if tower == "frozen":
        model = frozen_tower(model)
    assert any(p.requires_grad for p in model.parameters())
    plain_batch, engine_batch = vision_batches(family, tiny_processor(family))
    # the batch really holds images of different sizes (Qwen2.5-VL: grids; Idefics3: tile counts)
    ref_losses, ref_state = plain(model, plain_batch)
    runs = []
    for workers in (1, 2, 3):
        config = EngineConfig(devices=["cpu"] * workers, num_microbatches=3, optimizer="sgd", lr=0.1)
        losses, state, _ = engine_loop(model, [engine_batch] * STEPS, config)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < TOL, (losses, ref_losses)
        assert not far(state, ref_state), far(state, ref_state)[:3]
        runs.append((losses, state))
    for losses, state in runs[1:]:
        assert losses == runs[0][0]
        assert bitwise_equal(state, runs[0][1])
    if tower == "frozen":  # the frozen tower did not move
        from engine.vision.families import VISION_FAMILIES

        spec = VISION_FAMILIES[type(model).__name__]
        start = model.state_dict()
        moved = [
            k
            for k in start
            if k.startswith(spec.tower + ".") and not torch.equal(start[k].float(), runs[0][1][k])
        ]
        assert not moved, moved[:3]


@pytest.mark.parametrize("family", ENGINE_VLM_FAMILIES)
def test_a_split_partition_gives_the_same_bits(family: str) -> None:
    """A hand-made partition (two forward stages, a fused stage, two backward stages that
    recompute): the input layer with the tower recomputed in a backward stage."""
    model = tiny_vlm(family)
    _, engine_batch = vision_batches(family, tiny_processor(family))
    plan = {"forward": [1, 1], "fused": 2, "backward": [1, 1]}  # 4 layers: input, 2 blocks, output
    results = []
    for partition in (None, plan):
        config = EngineConfig(
            devices=["cpu"] * 2, num_microbatches=3, optimizer="sgd", lr=0.1, partition=partition
        )
        losses, state, used = engine_loop(model, [engine_batch] * 2, config)
        results.append((losses, state, used.describe()))
    assert results[0][2] != results[1][2]
    assert results[0][0] == results[1][0]
    assert bitwise_equal(results[0][1], results[1][1])


def test_images_that_do_not_match_the_image_tokens_are_refused() -> None:
    from engine import RoundPipe

    family = "qwen2_5_vl"
    _, batch = vision_batches(family, tiny_processor(family))
    batch["images"] = [batch["images"][1], batch["images"][1], None, batch["images"][3]]
    rp = RoundPipe(
        tiny_vlm(family), EngineConfig(devices=["cpu"], num_microbatches=1, optimizer="sgd", lr=0.1)
    )
    try:
        with pytest.raises(Exception, match=r"image features for .* image tokens"):
            rp.forward_backward(**batch)
    finally:
        rp.close()


def test_images_for_a_text_model_are_refused() -> None:
    from engine import RoundPipe
    from tests.engine.tiny import tiny_batch, tiny_model

    batch = tiny_batch(batch=2)
    rp = RoundPipe(
        tiny_model("llama"), EngineConfig(devices=["cpu"], num_microbatches=1, optimizer="sgd", lr=0.1)
    )
    try:
        with pytest.raises(ValueError, match="not a vision-language model"):
            rp.forward_backward(**batch, images=[None, None])
    finally:
        rp.close()


def test_qwen3_vl_hands_its_deepstack_features_to_the_first_blocks() -> None:
    """The input layer's output carries the hidden states and one deepstack feature per wrapped
    block; the features count (the plain loop's loss moves with them, and so does the engine's)."""
    from engine.model.adapter import AdaptedModel
    from engine.vision.layer import DeepstackBlock

    family = "qwen3_vl"
    model = tiny_vlm(family)
    adapted = AdaptedModel(model)
    wrapped = [layer.index for layer in adapted.layers if isinstance(layer.module, DeepstackBlock)]
    assert wrapped == [1, 2]  # deepstack_visual_indexes [0, 1]: the first two blocks
    _, batch = vision_batches(family, tiny_processor(family))
    rows = [0, 1]
    from engine.vision.batch import join_images

    images = join_images([batch["images"][r] for r in rows])
    assert images is not None
    with torch.no_grad():
        out = adapted.layers[0].module(batch["input_ids"][rows], **images)
    assert out.shape[-1] == 3 * model.config.text_config.hidden_size
    plain_batch, engine_batch = vision_batches(family, tiny_processor(family))
    config = EngineConfig(devices=["cpu"] * 2, num_microbatches=3, optimizer="sgd", lr=0.0)
    before, _, _ = engine_loop(model, [engine_batch], config)
    silenced = copy.deepcopy(model)
    with torch.no_grad():
        for p in silenced.model.visual.deepstack_merger_list.parameters():
            p.zero_()
    after, _, _ = engine_loop(silenced, [engine_batch], config)
    with torch.no_grad():
        plain_before = model(**plain_batch).loss.item()
        plain_after = silenced(**plain_batch).loss.item()
    assert abs(before[0] - plain_before) < TOL and abs(after[0] - plain_after) < TOL
    assert abs(before[0] - after[0]) > 1e-4
