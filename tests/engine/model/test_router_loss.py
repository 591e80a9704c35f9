"""The MoE routers' auxiliary loss: the engine against the model's own ``loss`` with router logits."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig
from engine.errors import ConfigError
from tests.engine.tiny import VOCAB, engine_loop, max_diff, plain_loop, tiny_batch

COEF = 0.5  # far above the usual 0.001, so a wrong router gradient shows in the weights


def moe_model(family: str, *, seed: int = 0, **extra: object) -> torch.nn.Module:
    """A tiny mixture-of-experts model: 4 blocks (one dense where the family has them), 4 experts."""
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        router_aux_loss_coef=COEF,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, num_experts=4, moe_intermediate_size=16, intermediate_size=48, mlp_only_layers=[1]
        )
        cls = Qwen3MoeForCausalLM
    else:
        config = GptOssConfig(
            **common,
            num_local_experts=4,
            intermediate_size=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
        cls = GptOssForCausalLM
    for key, value in extra.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # routers start at zero in some inits: give them real preferences
        for name, p in model.named_parameters():
            if "router" in name or ".gate." in name:
                p.normal_(0.0, 0.5)
    model.train()
    return model


def reference(model: torch.nn.Module) -> torch.nn.Module:
    """The same model, asked for router logits: its ``loss`` includes the auxiliary loss."""
    ref = copy.deepcopy(model)
    ref.config.output_router_logits = True
    return ref


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_router_loss_matches_the_models_own_loss(family: str) -> None:
    model = moe_model(family)
    batch = tiny_batch(batch=4, seq=12)
    with torch.no_grad():
        own = reference(model)(**batch)
        without = model(**batch).loss
    assert own.aux_loss is not None and float(own.aux_loss) > 1.0
    config = EngineConfig(
        devices=["cpu"],
        num_microbatches=1,
        optimizer="sgd",
        lr=0.0,
        router_aux_loss=True,
        calibration_steps=0,
    )
    losses, _, _ = engine_loop(model, [batch], config)
    assert losses[0] == pytest.approx(float(own.loss), rel=1e-6, abs=1e-6)
    assert abs(losses[0] - float(without)) > 1e-3  # the loss really was added


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("workers", [1, 3])
def test_router_loss_trains_like_the_plain_loop(family: str, workers: int) -> None:
    """3 SGD steps over 3 micro-batches through forward, fused and backward stages."""
    model = moe_model(family)
    batches = [tiny_batch(batch=6, seq=12, seed=s) for s in (1, 2, 3)]
    config = EngineConfig(
        devices=["cpu"] * workers,
        num_microbatches=3,
        optimizer="sgd",
        lr=0.1,
        router_aux_loss=True,
        partition={"forward": [2, 2], "fused": 2, "backward": [1, 3]},
    )
    ref_losses, ref_state = plain_loop(
        reference(model), batches, lambda p: torch.optim.SGD(p, lr=0.1), microbatches=3
    )
    losses, state, _ = engine_loop(model, batches, config)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert max_diff(state, ref_state) < 1e-5
    # and the auxiliary loss changed the routers: training without it ends elsewhere
    plain = EngineConfig(**{**vars(config), "router_aux_loss": False})
    _, other, _ = engine_loop(model, batches, plain)
    routers = [k for k in state if "router" in k or ".gate." in k]
    assert routers and max(float((state[k] - other[k]).abs().max()) for k in routers) > 1e-4


def test_router_loss_coefficient_overrides_the_models() -> None:
    model = moe_model("qwen3_moe")
    batch = tiny_batch(batch=4, seq=12)
    with torch.no_grad():
        out = reference(model)(**batch)
    config = EngineConfig(
        devices=["cpu"],
        num_microbatches=1,
        optimizer="sgd",
        lr=0.0,
        router_aux_loss=True,
        router_aux_loss_coef=2.0,
        calibration_steps=0,
    )
    losses, _, _ = engine_loop(model, [batch], config)
    ce = float(out.loss) - COEF * float(out.aux_loss)
    assert losses[0] == pytest.approx(ce + 2.0 * float(out.aux_loss), rel=1e-6)


def test_router_loss_needs_a_mixture_of_experts() -> None:
    from tests.engine.tiny import tiny_model

    with pytest.raises(ConfigError, match="not a mixture-of-experts") as err:
        engine_loop(tiny_model("llama"), [tiny_batch()], EngineConfig(router_aux_loss=True))
    assert err.value.field == "EngineConfig.router_aux_loss"
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        EngineConfig(router_aux_loss_coef=-1.0)


def test_router_loss_is_bitwise_the_same_on_any_number_of_workers() -> None:
    model = moe_model("qwen3_moe")
    batches = [tiny_batch(batch=6, seq=12, seed=s) for s in (1, 2)]
    states = []
    for workers in (1, 2):
        config = EngineConfig(
            devices=["cpu"] * workers,
            num_microbatches=3,
            optimizer="sgd",
            lr=0.1,
            router_aux_loss=True,
            partition={"forward": [2, 2], "fused": 2, "backward": [1, 3]},
        )
        states.append(engine_loop(model, batches, config)[1])
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_run_config_turns_the_router_loss_on() -> None:
    from engine.config import TrainConfig

    raw = {"data": {"train": "train.jsonl"}, "hyper": {"router_aux_loss": True, "router_aux_loss_coef": 0.01}}
    hyper = TrainConfig.parse(raw).hyper
    assert hyper.router_aux_loss and hyper.router_aux_loss_coef == 0.01
    assert TrainConfig.parse({"data": {"train": "train.jsonl"}}).hyper.router_aux_loss is False
    with pytest.raises(ConfigError) as err:
        TrainConfig.parse({**raw, "hyper": {"router_aux_loss_coef": -1}})
    assert err.value.field == "hyper.router_aux_loss_coef"


def test_router_loss_is_refused_by_the_pair_and_token_objectives() -> None:
    """DPO/ORPO pairs and GRPO's tokens have no router loss: the engine says so, naming the
    setting, before any work (the run config refuses it first; this is the library's guard)."""
    from engine import RoundPipe
    from engine.methods.grpo.train import GRPOObjective

    batch = tiny_batch(batch=4, seed=1)
    with RoundPipe(moe_model("qwen3_moe"), EngineConfig(router_aux_loss=True)) as rp:
        objective = GRPOObjective(torch.zeros(4))
        for call in (
            lambda: rp.forward_backward_tokens(objective, divisor=4, **batch),
            lambda: rp.forward_backward_pairs(objective, **batch),  # type: ignore[arg-type]
        ):
            with pytest.raises(ConfigError, match="router_aux_loss=True: not supported with GRPO") as exc:
                call()
            assert exc.value.field == "EngineConfig.router_aux_loss"
