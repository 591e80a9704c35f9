"""The optimizer registry: one table that the config, EngineConfig and the optimizer worker read."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, TrainConfig
from engine.errors import ConfigError
from engine.optimizers import OPTIMIZERS, optimizer_names, optimizer_spec


def test_the_registry_names_adamw_and_sgd() -> None:
    assert optimizer_names() == ("adamw", "sgd")
    assert all(spec.description for spec in OPTIMIZERS.values())


def test_an_unknown_optimizer_names_the_field_the_value_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r'hyper\.optimizer=\'lamb\': must be "adamw" or "sgd"') as exc:
        optimizer_spec("lamb", field="hyper.optimizer")
    assert exc.value.field == "hyper.optimizer" and exc.value.value == "lamb"
    with pytest.raises(
        ConfigError, match=r'EngineConfig\.optimizer=\'lamb\': must be "adamw" or "sgd"'
    ) as exc:
        EngineConfig(optimizer="lamb")
    assert exc.value.field == "EngineConfig.optimizer"
    with pytest.raises(
        ConfigError, match=r"hyper\.optimizer: Input should be 'adamw' or 'sgd' \(got \"lamb\"\)"
    ) as exc:
        TrainConfig.parse({"data": {"train": "x.jsonl"}, "hyper": {"optimizer": "lamb"}})
    assert exc.value.field == "hyper.optimizer"


def test_a_registered_optimizer_is_accepted_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = OPTIMIZERS["sgd"]
    monkeypatch.setitem(OPTIMIZERS, "plain_sgd", spec)
    assert EngineConfig(optimizer="plain_sgd").optimizer == "plain_sgd"
    config = TrainConfig.parse({"data": {"train": "x.jsonl"}, "hyper": {"optimizer": "plain_sgd"}})
    assert config.hyper.optimizer == "plain_sgd"


def test_adamw_is_the_fused_torch_adamw_with_the_config_hyperparameters() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    config = EngineConfig(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    opt = optimizer_spec("adamw").build([p], config)
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["fused"] is True
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.01, (0.8, 0.9), 1e-6, 0.1)


@pytest.mark.parametrize(("name", "momentum"), [("adamw", 0.0), ("sgd", 0.9)])
def test_state_bytes_per_param_is_the_state_after_a_step(name: str, momentum: float) -> None:
    p = torch.nn.Parameter(torch.ones(1000))
    opt = optimizer_spec(name).build([p], EngineConfig(optimizer=name, lr=0.1, momentum=momentum))
    p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state[p]
    measured = sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")
    assert measured == OPTIMIZERS[name].state_bytes_per_param * p.numel()
