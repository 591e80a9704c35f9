"""The optimizer's flat units: the same updates as per-tensor optimizers, checkpoints in their
layout, and gradient buffers that are written, not zeroed, between steps."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from engine import EngineConfig, RoundPipe
from engine.model.adapter import AdaptedModel
from engine.optimizers import optimizer_spec
from engine.parallel.host import HostState
from engine.parallel.units import build_units, global_norm
from tests.engine.tiny import tiny_model


def _host(family: str = "llama") -> HostState:
    model = tiny_model(family)
    return HostState(AdaptedModel(model), compute_dtype=torch.float32, pin=False, double_buffer=False)


def _fill_grads(host: HostState, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in host.trainable:
        assert t.master is not None and t.master.grad is not None
        t.master.grad.copy_(torch.randn(t.master.shape, generator=g) * 1e-2)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_units_update_like_per_tensor_optimizers_and_save_in_their_layout(optimizer: str) -> None:
    cfg = EngineConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1, momentum=0.9)
    host = _host()
    spec = optimizer_spec(optimizer)
    # the reference: per-tensor optimizers over copies of each unit's tensors
    refs = {}
    for owner, keys in enumerate(host.owned):
        params = [torch.nn.Parameter(host.tensors[k].master.detach().clone()) for k in keys]  # type: ignore[union-attr]
        if params:
            refs[owner] = (params, spec.build(params, cfg))
    units = build_units(host, spec, cfg)
    assert set(units) == set(refs) and units
    for step in range(3):
        _fill_grads(host, step)
        for owner, (params, opt) in refs.items():
            for p, k in zip(params, host.owned[owner], strict=True):
                p.grad = host.tensors[k].master.grad.clone()  # type: ignore[union-attr]
            opt.step()
        for unit in units.values():
            unit.step(1e-2)
    for owner, (params, opt) in refs.items():
        for p, k in zip(params, host.owned[owner], strict=True):
            # the views into the flat block are the masters: the same numbers as per tensor
            torch.testing.assert_close(host.tensors[k].master.detach(), p.detach(), rtol=0, atol=1e-7)  # type: ignore[union-attr]
        saved, want = units[owner].state_dict(), opt.state_dict()
        assert saved["param_groups"] == want["param_groups"]
        assert set(saved["state"]) == set(want["state"])
        for i, entry in want["state"].items():
            assert set(saved["state"][i]) == set(entry)
            for key, value in entry.items():
                got = saved["state"][i][key]
                if isinstance(value, torch.Tensor):
                    assert got.shape == value.shape and got.dtype == value.dtype, key
                    torch.testing.assert_close(got, value, rtol=0, atol=1e-7)
                else:
                    assert got == value


def test_a_unit_resumes_from_a_per_tensor_state_and_continues_identically() -> None:
    cfg = EngineConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1)
    spec = optimizer_spec("adamw")
    host = _host()
    units = build_units(host, spec, cfg)
    for step in range(2):
        _fill_grads(host, step)
        for unit in units.values():
            unit.step(1e-2)
    saved = {o: copy.deepcopy(u.state_dict()) for o, u in units.items()}
    masters = [t.master.detach().clone() for t in host.trainable]  # type: ignore[union-attr]

    other = _host()
    for t, m in zip(other.trainable, masters, strict=True):
        t.master.data.copy_(m)  # type: ignore[union-attr]
    resumed = build_units(other, spec, cfg)
    for owner, sd in saved.items():
        resumed[owner].load_state_dict(sd)
    for h, us in ((host, units), (other, resumed)):
        _fill_grads(h, 9)
        for unit in us.values():
            unit.step(1e-2)
    for a, b in zip(host.trainable, other.trainable, strict=True):
        assert torch.equal(a.master, b.master)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tensors"):
        first = next(iter(resumed))
        bad = copy.deepcopy(saved[first])
        bad["param_groups"][0]["params"] = bad["param_groups"][0]["params"][:-1]
        resumed[first].load_state_dict(bad)


def test_the_global_norm_and_the_clipping_are_those_of_clip_grad_norm() -> None:
    cfg = EngineConfig(optimizer="sgd", lr=1.0)
    host = _host()
    units = build_units(host, optimizer_spec("sgd"), cfg)
    _fill_grads(host, 3)
    grads = [t.master.grad.clone() for t in host.trainable]  # type: ignore[union-attr]
    want = torch.nn.utils.get_total_norm(grads)
    assert abs(float(global_norm(units)) - float(want)) < 1e-6 * float(want)
    before = [t.master.detach().clone() for t in host.trainable]  # type: ignore[union-attr]
    for unit in units.values():
        unit.step(1.0, grad_divisor=4.0)  # SGD: the gradients are divided before the update
    for t, b, g in zip(host.trainable, before, grads, strict=True):
        torch.testing.assert_close(t.master.detach(), b - g / 4.0, rtol=0, atol=1e-7)  # type: ignore[union-attr]


def test_gradient_buffers_are_written_by_the_first_contribution_and_settled_when_none_came() -> None:
    # an engine step on a model whose layers all contribute, then one where the buffers of
    # tensors without a contribution must read zero: the router of an MoE block the batch
    # never routes to is the classic case; here every buffer is dirtied, then marked unset
    host = _host()
    _fill_grads(host, 1)
    host.zero_grads()  # marks them unset: nothing is written
    assert all(t.master.grad.abs().sum() > 0 for t in host.trainable)  # type: ignore[union-attr]
    host.settle_grads()
    assert all(t.master.grad.abs().sum() == 0 for t in host.trainable)  # type: ignore[union-attr]
    assert host.unset == set()


def test_the_engine_trains_with_units_exactly_across_worker_counts() -> None:
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=g)
    results = []
    for devices in (["cpu"], ["cpu", "cpu", "cpu"]):
        cfg = EngineConfig(devices=devices, num_microbatches=4, optimizer="adamw", lr=1e-2, max_grad_norm=0.5)
        with RoundPipe(copy.deepcopy(model), cfg) as rp:
            for _ in range(3):
                rp.forward_backward(input_ids=ids, labels=ids)
                rp.step()
            rp.synchronize()
            results.append({k: v.clone() for k, v in rp.state_dict()["masters"].items()})
    for key, value in results[0].items():
        assert torch.equal(value, results[1][key]), key


def test_the_one_pass_kernel_matches_torch_fused_adamw_and_writes_the_compute_copies() -> None:
    from engine.parallel import kernels

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the torch path is the only one here")
    assert kernels.adamw() is not None  # built here: the comparison below is not torch vs torch
    cfg = EngineConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    spec = optimizer_spec("adamw")
    fast, slow = _host(), _host()
    units_fast, units_slow = build_units(fast, spec, cfg), build_units(slow, spec, cfg)
    for u in units_slow.values():
        u.kernel = None  # torch's fused AdamW, then a separate copy
    assert all(u.writes_copies for u in units_fast.values())
    copies = {
        o: [torch.empty_like(t, dtype=torch.bfloat16) for t in fast.compute_targets(o, 0)] for o in units_fast
    }
    for step in range(4):
        _fill_grads(fast, step)
        _fill_grads(slow, step)
        for owner in units_fast:
            units_fast[owner].step_writing(1e-2, copies[owner], grad_divisor=1.0 + step)
            units_slow[owner].step(1e-2, grad_divisor=1.0 + step)
    for owner in units_fast:
        for k, copy_ in zip(fast.owned[owner], copies[owner], strict=True):
            a, b = fast.tensors[k].master, slow.tensors[k].master
            assert a is not None and b is not None
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
            # the compute copy is the new master rounded as torch rounds it
            assert torch.equal(copy_, a.detach().to(torch.bfloat16))
        sa, sb = units_fast[owner].state_dict(), units_slow[owner].state_dict()
        for i in sa["state"]:
            assert float(sa["state"][i]["step"]) == float(sb["state"][i]["step"]) == 4.0
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(sa["state"][i][key], sb["state"][i][key], rtol=1e-6, atol=1e-9)


def test_the_fold_kernel_writes_and_adds_like_torch_and_measures_the_norm_as_it_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.parallel import kernels
    from engine.parallel.board import Board
    from engine.parallel.gradients import add_gradients

    if kernels.fold() is None:
        pytest.skip("no C compiler: the torch path is the only one here")
    hosts = {"kernel": _host(), "torch": _host()}
    g = torch.Generator().manual_seed(5)
    layer = max(range(len(hosts["kernel"].owned)), key=lambda i: len(hosts["kernel"].owned[i]))
    keys = hosts["kernel"].owned[layer]
    sizes = [hosts["kernel"].tensors[k].master.numel() for k in keys]  # type: ignore[union-attr]
    parts, offset = [], 0
    for k, n in zip(keys, sizes, strict=True):
        parts.append((k, offset, n))
        offset += n
    contributions = [torch.randn(offset, generator=g) for _ in range(3)]
    for name, host in hosts.items():
        if name == "torch":
            monkeypatch.setattr(kernels, "fold", lambda: None)
        host.zero_grads()
        for i, flat in enumerate(contributions):
            add_gradients(host, Board(len(host.owned)), (flat, None, parts, False), 1.0 if i else 0.5)
        host.settle_grads()
    for k in keys:
        a, b = hosts["kernel"].tensors[k].master, hosts["torch"].tensors[k].master
        assert a is not None and b is not None and torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
    measured = hosts["kernel"].grad_norm_sq()
    assert measured is not None and hosts["torch"].grad_norm_sq() is None  # torch: measured later
    want = sum(float(hosts["torch"].tensors[k].master.grad.double().square().sum()) for k in keys)  # type: ignore[union-attr]
    # float lanes, then double: as close as torch's own fp32 norm (the other layers got nothing: zero)
    assert measured == pytest.approx(want, rel=1e-6)


def _deposit(host: HostState, layer: int, seed: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """A layer's gradient deposit as a worker sends it: the tensors' gradients in the layer's
    order, then their squared norms."""
    g = torch.Generator().manual_seed(seed)
    parts, grads, offset = [], [], 0
    for k in host.layer_keys[layer].values():
        master = host.tensors[k].master
        if master is not None:
            parts.append((k, offset, master.numel()))
            grads.append(torch.randn(master.numel(), generator=g))
            offset += master.numel()
    norms = torch.stack([torch.linalg.vector_norm(x) for x in grads]).square()
    return torch.cat([*grads, norms]), parts


def test_a_deposit_laid_out_as_a_unit_becomes_its_gradient_without_a_copy() -> None:
    from engine.parallel.board import Board
    from engine.parallel.gradients import add_gradients

    host, ref = _host(), _host()
    board = Board(len(host.owned))
    layer = max(range(len(host.owned)), key=lambda i: len(host.owned[i]))
    keys = host.unit_keys(layer)
    assert len(keys) > 1
    first, parts = _deposit(host, layer, 1)
    add_gradients(host, board, (first, None, parts, True), 1.0)
    # adopted: the unit's block is the deposit's head, each tensor's norm the one sent with it
    assert host.unit_grads[layer].data_ptr() == first.data_ptr()
    assert not set(keys) & host.unset
    for (k, offset, _), sq in zip(parts, first[-len(parts) :].tolist(), strict=True):
        master = host.tensors[k].master
        assert master is not None and master.grad is not None
        assert master.grad.data_ptr() == first[offset:].data_ptr()
        assert host.grad_sq[k] == sq
    # a second contribution to the same step is added into it, and its buffer goes back
    second, _ = _deposit(host, layer, 2)
    add_gradients(host, board, (second, None, parts, True), 1.0)
    total = sum(n for _, _, n in parts)
    assert host.unit_grads[layer].data_ptr() == first.data_ptr()
    assert board.take_buffer(second.numel()) is second
    # the next step's first deposit replaces the block; the one it replaces goes back too
    host.zero_grads()
    third, _ = _deposit(host, layer, 3)
    add_gradients(host, board, (third, None, parts, True), 1.0)
    assert host.unit_grads[layer].data_ptr() == third.data_ptr()
    assert board.take_buffer(first.numel()) is first
    # the unit steps on the adopted gradient exactly as on the same numbers written in place
    cfg = EngineConfig(lr=1e-2, weight_decay=0.1)
    spec = optimizer_spec("adamw")
    unit, twin = build_units(host, spec, cfg)[layer], build_units(ref, spec, cfg)[layer]
    ref.unit_grads[layer].copy_(third[:total])
    unit.step(1e-2)
    twin.step(1e-2)
    assert torch.equal(unit.param.detach(), twin.param.detach())
    assert unit.param.grad is None  # the unit holds no gradient block between steps


def test_the_optimizer_thread_budget_leaves_gpu_workers_a_core_each() -> None:
    from engine.errors import ConfigError
    from engine.parallel.optimizer import optimizer_threads

    cores = torch.get_num_threads()
    assert optimizer_threads(EngineConfig(devices=["cpu", "cpu"])) == cores
    assert optimizer_threads(EngineConfig(devices=["cuda:0", "cuda:1"])) == max(1, cores - 2)
    assert optimizer_threads(EngineConfig(devices=["cuda:0"], optimizer_threads=3)) == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="optimizer_threads"):
            EngineConfig(optimizer_threads=bad)  # type: ignore[arg-type]
