"""The correctness contract: RoundPipe trains exactly like a plain single-device loop."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig, RoundPipe
from tests.engine.tiny import (
    FAMILIES,
    MOE_FAMILIES,
    SPLIT_PLAN,
    bitwise_equal,
    engine_loop,
    max_diff,
    plain_loop,
    tiny_batch,
    tiny_model,
)

SGD_TOL = 1e-5
# AdamW divides by sqrt(v): entries whose gradient is near zero turn float rounding into
# visible steps. Measured after 3 steps at lr 1e-2 (each step moves a weight by up to 1e-2):
# - a plain PyTorch loop over the whole batch vs the same loop accumulating 4 micro-batches
#   differs by up to 3.1e-4 on one machine and 5.2e-4 on another (llama) in weights, 4.1e-6 in
#   loss; it depends on the CPU's kernels, so the engine is held to that same distance (plus
#   the same-split tolerance) rather than to a fixed number;
# - the engine vs the plain loop accumulating the same micro-batches differs by <= 4.1e-6
#   (qwen2), 1.5e-7 (llama).
ADAMW_WHOLE_BATCH_TOL = 1e-3  # bound on the plain loop's own whole-batch vs split distance
ADAMW_LOSS_TOL = 1e-5
ADAMW_SAME_SPLIT_TOL = 1e-5


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_sync_sgd_equals_plain_loop(family: str, workers: int, batches) -> None:
    model = tiny_model(family)
    ref_losses, ref_state = plain_loop(model, batches, sgd)
    for m in (workers, workers + 1, 2 * workers + 1):
        config = EngineConfig(devices=["cpu"] * workers, num_microbatches=m, optimizer="sgd", lr=0.1)
        losses, state, _ = engine_loop(model, batches, config)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < SGD_TOL, (
            m,
            losses,
            ref_losses,
        )
        assert max_diff(state, ref_state) < SGD_TOL, m


@pytest.mark.parametrize("family", FAMILIES)
def test_bitwise_identical_for_any_worker_count_and_partition(family: str, batches) -> None:
    model = tiny_model(family)
    results = []
    for workers in (1, 2, 3, 4):
        for plan in (None, SPLIT_PLAN):
            config = EngineConfig(
                devices=["cpu"] * workers, num_microbatches=5, optimizer="sgd", lr=0.1, partition=plan
            )
            losses, state, used = engine_loop(model, batches, config)
            results.append((workers, used.describe(), losses, state))
    # the runs really used different partitions (several stages, recompute, the fused stage)
    assert len({r[1] for r in results}) >= 2
    _, _, losses0, state0 = results[0]
    for workers, plan, losses, state in results[1:]:
        assert losses == losses0, (workers, plan)
        assert bitwise_equal(state, state0), (workers, plan)


def test_tied_embedding_gradient_is_the_sum_of_both_uses(batches) -> None:
    model = tiny_model("llama", tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _, ref_state = plain_loop(model, batches, sgd)
    config = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd", lr=0.1, partition=SPLIT_PLAN
    )
    _, state, _ = engine_loop(model, batches, config)
    assert max_diff(state, ref_state) < SGD_TOL
    # one parameter: both names carry the same trained value, and it moved
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert not torch.equal(state["lm_head.weight"], model.lm_head.weight.float())


@pytest.mark.parametrize("family", FAMILIES)
def test_adamw_with_clipping_matches_torch_adamw(family: str, batches) -> None:
    model = tiny_model(family)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    ref_losses, ref_state = plain_loop(model, batches, adamw, max_grad_norm=0.5)
    _, split_state = plain_loop(model, batches, adamw, max_grad_norm=0.5, microbatches=4)
    config = EngineConfig(
        devices=["cpu", "cpu", "cpu"],
        num_microbatches=4,
        optimizer="adamw",
        lr=1e-2,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        max_grad_norm=0.5,
        partition=SPLIT_PLAN,
    )
    losses, state, _ = engine_loop(model, batches, config)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < ADAMW_LOSS_TOL
    rounding = max_diff(split_state, ref_state)  # the plain loop's own split-vs-whole distance
    assert rounding < ADAMW_WHOLE_BATCH_TOL
    assert max_diff(state, ref_state) < rounding + ADAMW_SAME_SPLIT_TOL
    assert max_diff(state, split_state) < ADAMW_SAME_SPLIT_TOL


def test_sgd_momentum_weight_decay_and_lr_per_step(batches) -> None:
    model = tiny_model("mistral")
    lrs = [0.1, 0.05, 0.02]
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lrs[0], momentum=0.9, weight_decay=0.01)
    for lr, batch in zip(lrs, batches, strict=True):
        opt.param_groups[0]["lr"] = lr
        ref(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    config = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd", momentum=0.9, weight_decay=0.01
    )
    with RoundPipe(copy.deepcopy(model), config) as rp:
        for lr, batch in zip(lrs, batches, strict=True):
            rp.forward_backward(**batch)
            rp.step(lr=lr)
        state = rp.master_state_dict()
    assert max_diff(state, {k: v.float() for k, v in ref.state_dict().items()}) < SGD_TOL


def test_gradient_accumulation_over_calls_equals_one_big_batch() -> None:
    model = tiny_model("llama")
    halves = [tiny_batch(batch=4, seed=5), tiny_batch(batch=4, seed=6)]
    whole = {k: torch.cat([h[k] for h in halves]) for k in halves[0]}
    _, ref_state = plain_loop(model, [whole], sgd)
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=2, optimizer="sgd", lr=0.1)
    with RoundPipe(copy.deepcopy(model), config) as rp:
        counts = [int((h["labels"][:, 1:] != -100).sum()) for h in halves]
        for h in halves:
            rp.forward_backward(**h)
        rp.step()
        state = rp.master_state_dict()
    # two calls give the sum of two per-call means, not the whole-batch mean: compare to that
    ref_model = copy.deepcopy(model)
    for h in halves:
        ref_model(**h).loss.backward()
    with torch.no_grad():
        for p in ref_model.parameters():
            p -= 0.1 * p.grad
    expected = {k: v.float() for k, v in ref_model.state_dict().items()}
    assert max_diff(state, expected) < SGD_TOL
    assert max_diff(state, ref_state) > SGD_TOL  # and it is genuinely different from one big batch
    assert sum(counts) == int((whole["labels"][:, 1:] != -100).sum())


def test_async_equals_staleness_one_reference() -> None:
    model = tiny_model("qwen2")
    batches = [tiny_batch(seed=s) for s in range(1, 6)]
    lr = 0.1
    # explicit staleness-1 loop: the gradient of iteration t is taken at the weights after
    # step t-2 (the first two iterations at the initial weights) and applied to those after t-1
    history = [copy.deepcopy(model)]
    current = copy.deepcopy(model)
    ref_losses = []
    for t, batch in enumerate(batches, start=1):
        at = copy.deepcopy(history[max(t - 2, 0)])
        loss = at(**batch).loss
        loss.backward()
        ref_losses.append(loss.item())
        with torch.no_grad():
            for p, q in zip(current.parameters(), at.parameters(), strict=True):
                p -= lr * q.grad
        history.append(copy.deepcopy(current))
    ref_state = {k: v.float() for k, v in current.state_dict().items()}
    for workers in (1, 3):
        config = EngineConfig(
            devices=["cpu"] * workers,
            num_microbatches=4,
            optimizer="sgd",
            lr=lr,
            async_optimizer=True,
            partition=SPLIT_PLAN,
        )
        losses, state, _ = engine_loop(model, batches, config)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < SGD_TOL
        assert max_diff(state, ref_state) < SGD_TOL
    # and it is not the sync result
    _, sync_state = plain_loop(model, batches, sgd)
    assert max_diff(state, sync_state) > 1e-4


def test_lora_trains_only_the_adapter_like_the_plain_loop(batches) -> None:
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", tied=False)
    lora = get_peft_model(
        base,
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    # peft initialises B to zero: start from a non-zero adapter so both factors get gradients
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    before = {k: v.detach().clone() for k, v in lora.state_dict().items()}
    ref_losses, ref_state = plain_loop(lora, batches, sgd)
    # the second plan has a backward stage starting right above the frozen input layer
    for plan in (SPLIT_PLAN, {"forward": [1, 2], "fused": 2, "backward": [2, 1]}):
        config = EngineConfig(
            devices=["cpu", "cpu", "cpu"], num_microbatches=3, optimizer="sgd", lr=0.1, partition=plan
        )
        with RoundPipe(copy.deepcopy(lora), config) as rp:
            trainable = {t.names[0] for t in rp.host.trainable}
            assert trainable and all("lora_" in n for n in trainable)
            assert all(t.master is None for t in rp.host.tensors if not t.trainable)
            losses = []
            for batch in batches:
                losses.append(rp.forward_backward(**batch))
                rp.step()
            state = rp.master_state_dict()
        assert set(state) == set(before)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < SGD_TOL
        assert max_diff(state, ref_state) < SGD_TOL
        for k, v in before.items():
            changed = not torch.equal(state[k], v.float())
            assert changed == ("lora_" in k), k


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama", "qwen2", "qwen3", "mistral")])
def test_lora_on_the_family_default_targets_matches_the_plain_loop(family: str, batches) -> None:
    from peft import LoraConfig, get_peft_model

    from engine.model.families import family_for

    base = tiny_model(family)
    targets = list(family_for(type(base).__name__).lora_targets)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in lora.named_parameters() if "lora_A" in n}
    assert adapted == set(targets)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    ref_losses, ref_state = plain_loop(lora, batches, sgd)
    config = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd", lr=0.1, partition=SPLIT_PLAN
    )
    losses, state, _ = engine_loop(lora, batches, config)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < SGD_TOL
    assert max_diff(state, ref_state) < SGD_TOL


def test_gpt_oss_attention_sinks_train_like_the_plain_loop(batches) -> None:
    # the sinks are parameters of the attention module, a block tensor like any other
    model = tiny_model("gpt_oss")
    _, ref_state = plain_loop(model, batches, sgd)
    config = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd", lr=0.1, partition=SPLIT_PLAN
    )
    _, state, _ = engine_loop(model, batches, config)
    sinks = [k for k in state if k.endswith("self_attn.sinks")]
    assert len(sinks) == model.config.num_hidden_layers
    initial = model.state_dict()
    for k in sinks:
        assert (state[k] - ref_state[k]).abs().max() < SGD_TOL
        assert (ref_state[k] - initial[k]).abs().max() > 1e-6, k  # they moved (by 5e-5 to 1e-4)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lora_on_attention_and_experts_matches_the_plain_loop(family: str, batches) -> None:
    # peft adapts the fused 3-D expert weights through target_parameters (a ParamWrapper that
    # parametrizes the weight during its forward); the engine runs it on each stage's tensors
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import ParamWrapper

    from engine.model.families import family_for

    base = tiny_model(family)
    spec = family_for(type(base).__name__)
    lora = get_peft_model(
        base,
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=list(spec.lora_targets),
            target_parameters=list(spec.expert_parameters),
        ),
    )
    assert {m.parameter_name for m in lora.modules() if isinstance(m, ParamWrapper)} == {
        "gate_up_proj",
        "down_proj",
    }
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    before = {k: v.detach().clone() for k, v in lora.state_dict().items()}
    ref_losses, ref_state = plain_loop(lora, batches, sgd)
    results = []
    for workers, plan in ((1, None), (3, SPLIT_PLAN)):
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=3, optimizer="sgd", lr=0.1, partition=plan
        )
        losses, state, _ = engine_loop(lora, batches, config)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < SGD_TOL
        assert max_diff(state, ref_state) < SGD_TOL
        results.append((losses, state))
    assert results[0][0] == results[1][0] and bitwise_equal(results[0][1], results[1][1])
    # the expert adapters trained, and only the adapters
    experts = [k for k in before if ".experts." in k and "lora_" in k]
    assert experts and all(not torch.equal(ref_state[k], before[k].float()) for k in experts)
    for k, v in before.items():
        assert (not torch.equal(results[0][1][k], v.float())) == ("lora_" in k), k


def test_bf16_compute_stays_close_to_fp32(batches) -> None:
    model = tiny_model("qwen3")
    fp32 = EngineConfig(devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd", lr=0.1)
    bf16 = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=3, optimizer="sgd", lr=0.1, compute_dtype="bfloat16"
    )
    l32, s32, _ = engine_loop(model, batches, fp32)
    l16, s16, _ = engine_loop(model, batches, bf16)
    # bf16 keeps 8 bits of mantissa: losses agree to ~1e-2 relative, the fp32 masters to ~1e-2
    assert max(abs(a - b) / a for a, b in zip(l16, l32, strict=True)) < 2e-2
    assert max_diff(s16, s32) < 2e-2
    assert max_diff(s16, s32) > 0  # it really computed in bf16


def test_dropout_masks_match_between_forward_and_recompute(batches) -> None:
    model = tiny_model("llama", attention_dropout=0.2)
    results = []
    for workers, plan in ((1, {"forward": [], "fused": 5, "backward": []}), (2, SPLIT_PLAN), (3, SPLIT_PLAN)):
        config = EngineConfig(
            devices=["cpu"] * workers, num_microbatches=3, optimizer="sgd", lr=0.1, partition=plan
        )
        results.append(engine_loop(model, batches, config))
    # the fused-only plan never recomputes; the split plan recomputes every backward stage.
    # Equal weights mean every recompute drew the same dropout mask as its forward.
    for losses, state, _ in results[1:]:
        assert losses == results[0][0]
        assert bitwise_equal(state, results[0][1])
    # and dropout was really active: the weights differ from the no-dropout run
    no_dropout = engine_loop(
        tiny_model("llama"), batches, EngineConfig(num_microbatches=3, optimizer="sgd", lr=0.1)
    )
    assert max_diff(no_dropout[1], results[0][1]) > 1e-6
