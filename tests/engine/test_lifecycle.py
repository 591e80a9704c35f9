"""Failures, cancellation, closing, resuming and metrics of the engine."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading

import pytest
import torch

from engine import Cancelled, EngineConfig, EngineError, RoundPipe
from engine.metrics import ListSink
from tests.engine.tiny import SPLIT_PLAN, VOCAB, bitwise_equal, tiny_batch, tiny_model


def test_worker_error_names_stage_and_worker_and_a_new_engine_works() -> None:
    model = tiny_model("llama")
    bad = tiny_batch()
    bad["input_ids"][0, 0] = VOCAB + 5  # out of the embedding table: fails inside stage F1
    rp = RoundPipe(
        copy.deepcopy(model), EngineConfig(devices=["cpu", "cpu"], num_microbatches=3, partition=SPLIT_PLAN)
    )
    with pytest.raises(EngineError, match=r"stage F1 \(layers 0-1\) on worker 0 \(cpu\).*IndexError"):
        rp.forward_backward(**bad)
    # the engine stays failed, with the same error, until closed
    with pytest.raises(EngineError, match="stage F1"):
        rp.forward_backward(**tiny_batch())
    threads = [w.thread for w in rp.workers] + [rp.optimizer.thread]
    rp.close()
    rp.close()  # twice is fine
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="closed"):
        rp.forward_backward(**tiny_batch())
    with RoundPipe(copy.deepcopy(model), EngineConfig(devices=["cpu", "cpu"], num_microbatches=3)) as again:
        loss = again.forward_backward(**tiny_batch())
        again.step()
        again.synchronize()
    assert 0 < loss < 10


def test_error_in_a_backward_stage_surfaces_from_forward_backward() -> None:
    model = tiny_model("qwen3")
    rp = RoundPipe(
        copy.deepcopy(model),
        EngineConfig(devices=["cpu", "cpu", "cpu"], num_microbatches=3, partition=SPLIT_PLAN),
    )
    # break block 1 (layer 2) when autograd records: forward stage F2 runs without autograd and
    # passes, the recompute in backward stage B2 (slot 3, on worker 3 mod 3 = 0) fails
    for w in rp.workers:
        original = w.modules[2].forward

        def boom(*args, _original=original, **kwargs):
            if torch.is_grad_enabled():
                raise RuntimeError("simulated device fault")
            return _original(*args, **kwargs)

        w.modules[2].forward = boom  # type: ignore[method-assign]
    with pytest.raises(EngineError, match=r"stage B2 \(layers 2-2\) on worker 0 .*simulated device fault"):
        rp.forward_backward(**tiny_batch())
    rp.close()


def test_threads_stop_on_close() -> None:
    before = {t.name for t in threading.enumerate()}
    rp = RoundPipe(tiny_model("llama"), EngineConfig(devices=["cpu"] * 3, num_microbatches=3))
    rp.forward_backward(**tiny_batch())
    rp.step()
    assert any(t.name.startswith("roundpipe-") for t in threading.enumerate())
    rp.close()
    after = {t.name for t in threading.enumerate() if t.is_alive()}
    assert not {n for n in after - before if n.startswith("roundpipe-")}


def test_cancel_stops_between_microbatches_and_keeps_a_consistent_state() -> None:
    model = tiny_model("mistral")
    cancel = threading.Event()
    config = EngineConfig(
        devices=["cpu", "cpu"], num_microbatches=4, optimizer="sgd", lr=0.1, partition=SPLIT_PLAN
    )
    rp = RoundPipe(copy.deepcopy(model), config, cancel=cancel)
    rp.forward_backward(**tiny_batch(seed=1))
    rp.step()
    saved = rp.state_dict()
    cancel.set()
    with pytest.raises(Cancelled, match="cancelled before micro-batch"):
        rp.forward_backward(**tiny_batch(seed=2))
    rp.synchronize()
    # the cancelled iteration left no trace: state equals the one at the last step
    after = rp.state_dict()
    assert bitwise_equal(after["masters"], saved["masters"])
    assert all(t.master.grad.abs().sum() == 0 for t in rp.host.trainable)
    # and training continues from there exactly like an engine that never saw the cancel
    cancel.clear()
    rp.forward_backward(**tiny_batch(seed=3))
    rp.step()
    resumed = rp.master_state_dict()
    rp.close()
    with RoundPipe(copy.deepcopy(model), config) as clean:
        clean.forward_backward(**tiny_batch(seed=1))
        clean.step()
        clean.forward_backward(**tiny_batch(seed=3))
        clean.step()
        expected = clean.master_state_dict()
    assert bitwise_equal(resumed, expected)


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_resume_is_bitwise_exact(async_optimizer: bool) -> None:
    model = tiny_model("qwen2")
    batches = [tiny_batch(seed=s) for s in range(1, 7)]
    config = EngineConfig(
        devices=["cpu", "cpu"],
        num_microbatches=3,
        optimizer="adamw",
        lr=1e-2,
        weight_decay=0.1,
        max_grad_norm=1.0,
        async_optimizer=async_optimizer,
        calibration_steps=0,
    )

    def train(rp: RoundPipe, part: list) -> list[float]:
        out = []
        for b in part:
            out.append(rp.forward_backward(**b))
            rp.step()
        return out

    with RoundPipe(copy.deepcopy(model), config) as rp:
        straight = train(rp, batches)
        expected = rp.master_state_dict()
    with RoundPipe(copy.deepcopy(model), config) as rp:
        first = train(rp, batches[:3])
        state = rp.state_dict()
    with RoundPipe(copy.deepcopy(model), copy.deepcopy(config)) as rp:
        rp.load_state_dict(state)
        second = train(rp, batches[3:])
        resumed = rp.master_state_dict()
    assert first + second == straight
    assert bitwise_equal(resumed, expected)


def test_load_state_dict_rejects_another_model() -> None:
    with RoundPipe(tiny_model("llama"), EngineConfig(num_microbatches=2)) as rp:
        rp.forward_backward(**tiny_batch())
        rp.step()
        state = rp.state_dict()
    with (
        RoundPipe(tiny_model("llama", blocks=2), EngineConfig(num_microbatches=2)) as other,
        pytest.raises(ValueError, match=r"missing \[.*layers\.2"),
    ):
        other.load_state_dict(state)


def test_metrics_reach_the_sink_each_step() -> None:
    sink = ListSink()
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=4, max_grad_norm=1.0)
    with RoundPipe(tiny_model("qwen3"), config, sink=sink) as rp:
        losses = []
        for s in range(3):
            losses.append(rp.forward_backward(**tiny_batch(seed=s)))
            rp.step()
        rp.synchronize()
    assert [step for step, _ in sink.records] == [1, 2, 3]
    assert sink.series("loss/train") == pytest.approx(losses)
    for _, m in sink.records:
        assert m["tokens/label"] > 0
        assert m["throughput/tokens_per_s"] > 0
        assert m["optim/grad_norm"] > 0
        assert m["time/optimizer_s"] > 0
        assert 0 <= m["pipeline/bubble_ratio"] < 1
        assert any(k.startswith("time/stage/") for k in m)
    assert sink.events and sink.events[0][0] == "partition"


def test_bad_inputs_are_rejected_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"num_microbatches=0"):
        EngineConfig(num_microbatches=0)
    with pytest.raises(ValueError, match=r"devices.*'gpu'"):
        EngineConfig(devices=["gpu"])
    with pytest.raises(ValueError, match=r"compute_dtype='int8'"):
        EngineConfig(compute_dtype="int8")
    with pytest.raises(ValueError, match=r"optimizer='lamb'"):
        EngineConfig(optimizer="lamb")
    with RoundPipe(tiny_model("llama"), EngineConfig(num_microbatches=4)) as rp:
        with pytest.raises(ValueError, match="batch of 2 sequences cannot fill num_microbatches=4"):
            rp.forward_backward(**tiny_batch(batch=2))
        b = tiny_batch()
        b["labels"][:] = -100
        with pytest.raises(ValueError, match="no token to train on"):
            rp.forward_backward(**b)
        with pytest.raises(ValueError, match=r"labels shape \(7, 11\)"):
            rp.forward_backward(input_ids=b["input_ids"], labels=b["labels"][:, :-1])
        with pytest.raises(ValueError, match=r"step\(lr=-1"):
            rp.forward_backward(**tiny_batch())
            rp.step(lr=-1)


def test_unsupported_architecture_is_named() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel"):
        RoundPipe(model, EngineConfig())


def test_manual_plan_is_validated_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="5"):
        RoundPipe(tiny_model("llama"), EngineConfig(partition={"forward": [1], "fused": 2, "backward": [2]}))


def test_import_engine_loads_no_service_module_and_touches_no_device() -> None:
    code = (
        "import sys, engine\n"
        "from engine import EngineConfig\n"
        "banned = [m for m in sys.modules if m.split('.')[0] in "
        "('server', 'fastapi', 'celery', 'sqlalchemy', 'starlette', 'kombu')]\n"
        "assert not banned, banned\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
        "import threading; assert threading.active_count() == 1, threading.enumerate()\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_bare_import_does_not_even_load_torch() -> None:
    code = "import sys, engine, engine.metrics\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_bitwise_identical_with_rounds_smaller_than_the_iteration() -> None:
    # rounds of 2 micro-batches (M_R = N) give the same bits whatever the worker count
    model = tiny_model("llama")
    states = []
    for workers in (1, 2):
        config = EngineConfig(
            devices=["cpu"] * workers,
            num_microbatches=6,
            round_size=2,
            optimizer="sgd",
            lr=0.1,
            partition=SPLIT_PLAN,
        )
        with RoundPipe(copy.deepcopy(model), config) as rp:
            for s in (1, 2):
                rp.forward_backward(**tiny_batch(batch=9, seed=s))
                rp.step()
            states.append(rp.master_state_dict())
    assert bitwise_equal(states[0], states[1])
    assert torch.isfinite(next(iter(states[0].values()))).all()


def test_partition_is_recomputed_from_measured_layer_times() -> None:
    sink = ListSink()
    config = EngineConfig(devices=["cpu", "cpu", "cpu"], num_microbatches=3, calibration_steps=2)
    with RoundPipe(tiny_model("llama", blocks=4), config, sink=sink) as rp:
        for s in range(4):
            rp.forward_backward(**tiny_batch(seed=s))
            rp.step()
        rp.synchronize()
    kinds = [kind for kind, _, _ in sink.events]
    assert kinds == ["partition", "repartition"]
    counts = sink.events[1][2]
    assert "step  w0     w1     w2" in counts["grid"]
    assert sum(counts["forward"]) + counts["fused"] == 6
    assert sum(counts["backward"]) + counts["fused"] == 6


def test_async_cancel_after_the_loss_was_returned_does_not_empty_that_step() -> None:
    cancel = threading.Event()
    sink = ListSink()
    config = EngineConfig(
        devices=["cpu", "cpu"],
        num_microbatches=4,
        optimizer="sgd",
        lr=0.1,
        async_optimizer=True,
        partition=SPLIT_PLAN,
    )
    with RoundPipe(tiny_model("llama"), config, sink=sink, cancel=cancel) as rp:
        rp.forward_backward(**tiny_batch(seed=1))
        cancel.set()  # the backward stages of that iteration may still be running
        rp.step()
        with pytest.raises(Cancelled):
            rp.forward_backward(**tiny_batch(seed=2))
        rp.synchronize()
    assert sink.records[0][1]["optim/grad_norm"] > 0


def test_cancel_with_a_frozen_input_layer_leaves_no_gradient_behind() -> None:
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(
        tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    cancel = threading.Event()
    # the last backward stage holds only the frozen input layer: it deposits nothing
    plan = {"forward": [1, 2], "fused": 2, "backward": [2, 1]}
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=4, optimizer="sgd", lr=0.1, partition=plan)
    with RoundPipe(lora, config, cancel=cancel) as rp:
        original = rp.workers[0].modules[0].forward
        for w in rp.workers:

            def cancelling(*args, _original=original, **kwargs):
                if torch.is_grad_enabled():
                    cancel.set()
                return _original(*args, **kwargs)

            w.modules[0].forward = cancelling  # type: ignore[method-assign]
        with pytest.raises(Cancelled):
            rp.forward_backward(**tiny_batch(batch=8))
        rp.synchronize()
        assert all(float(t.master.grad.abs().sum()) == 0 for t in rp.host.trainable)


def test_cancel_during_calibration_keeps_the_engine_usable() -> None:
    cancel = threading.Event()
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=3, calibration_steps=2)
    with RoundPipe(tiny_model("qwen3"), config, cancel=cancel) as rp:
        rp.forward_backward(**tiny_batch(seed=1))
        rp.step()
        cancel.set()
        with pytest.raises(Cancelled):
            rp.forward_backward(**tiny_batch(seed=2))
        cancel.clear()
        for s in range(3, 6):
            assert rp.forward_backward(**tiny_batch(seed=s)) > 0
            rp.step()
        rp.synchronize()


def test_float16_compute_with_dynamic_loss_scaling() -> None:
    model = tiny_model("llama")
    batches = [tiny_batch(seed=s) for s in range(1, 13)]
    # a scale far too large: the first steps overflow, are skipped, and the scale halves each time
    config = EngineConfig(
        devices=["cpu", "cpu"],
        num_microbatches=3,
        optimizer="sgd",
        lr=0.1,
        compute_dtype="float16",
        initial_loss_scale=2.0**20,
    )
    runs = []
    for _ in range(2):
        sink = ListSink()
        with RoundPipe(copy.deepcopy(model), config, sink=sink) as rp:
            for b in batches:
                rp.forward_backward(**b)
                rp.step()
            runs.append((rp.master_state_dict(), sink.series("optim/skipped")))
    # the scale an iteration uses belongs to its weights version, not to the moment it launched:
    # two runs skip the same steps and end bitwise equal
    (state, skipped_a), (state_b, skipped_b) = runs
    assert skipped_a == skipped_b
    assert all(torch.equal(state[k], state_b[k]) for k in state)
    skipped = sink.series("optim/skipped")
    scales = sink.series("optim/loss_scale")
    # the first step overflows; after that the scale halves exactly on each overflowing step and
    # stays otherwise (growth needs 1000 good steps). Which later steps overflow depends on the
    # CPU's float16 kernels, so the test checks the rule, not a fixed sequence.
    assert skipped[0] == 1.0 and scales[0] == 2.0**19, (skipped, scales)
    for i in range(1, len(skipped)):
        expected = scales[i - 1] / 2 if skipped[i] else scales[i - 1]
        assert scales[i] == expected, (i, skipped, scales)
    assert sum(skipped) <= len(skipped) // 2, skipped
    assert all(torch.isfinite(v).all() for v in state.values())
    # the steps that went through trained: the weights moved, close to an fp32 run of those steps
    assert not torch.equal(state["lm_head.weight"], model.lm_head.weight.float())
