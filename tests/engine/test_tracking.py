"""Experiment trackers against the real things: TensorBoard files read back with TensorBoard's own
reader, a W&B offline run's file read back, a real MLflow server read back with MLflow's client,
and a tracker that is down (the run neither fails nor waits)."""

from __future__ import annotations

import glob
import hashlib
import json
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.metrics import ListSink
from engine.tracking import Point, RetryPolicy, TrackerSecrets, TrackingOptions
from engine.tracking.background import Background
from engine.training.run import train
from tests.engine.mlflow_server import MlflowServer, free_port
from tests.engine.tiny import tiny_model_folder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tracking")
    tiny_model_folder(d / "model", "llama")
    rows = [
        {"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]}
        for a in range(5)
        for b in range(4)
    ]
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


def config(d: Path, out: str, tracking: dict, steps: int = 4) -> TrainConfig:
    return TrainConfig.parse(
        {
            "model": {"path": str(d / "model"), "name": "tiny-llama"},
            "data": {"train": str(d / "train.jsonl"), "validation_fraction": 0.2, "max_length": 48},
            "method": {"kind": "lora", "lora_r": 4, "lora_alpha": 8},
            "hyper": {"max_steps": steps, "batch_size": 4, "learning_rate": 3e-3},
            "engine": {"devices": ["cpu"], "num_microbatches": 2},
            "checkpoint": {"every_steps": 2, "keep_last": 2},
            "eval": {"every_steps": 2},
            "tracking": tracking,
            "output_dir": str(d / out),
        }
    )


def wandb_records(path: Path) -> list:
    """The records of a W&B run file: its log format (blocks of 32 KiB, 7-byte record headers:
    CRC, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4) holding W&B's protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def test_tensorboard_and_wandb_offline_get_the_run(workspace: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracking = {"tensorboard": True, "wandb": {"project": "rh", "mode": "offline", "tags": ["t1"]}}
    sink = ListSink()
    result = train(config(workspace, "tb", tracking), sink, tracking=TrackingOptions(name="job-tb"))
    assert result.status == "succeeded"
    assert not [e for e in sink.events if e[0] == "tracker"], sink.events
    losses = {step: m["loss/train"] for step, m in sink.records if "loss/train" in m}

    runs = glob.glob(str(workspace / "tb" / "tensorboard" / "events.out.tfevents.*"))
    assert runs
    acc = EventAccumulator(str(workspace / "tb" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {e.step: e.value for e in acc.Scalars("loss/train")}
    assert scalars == pytest.approx(losses, rel=1e-6) and sorted(scalars) == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("loss/val")] == [2, 4]
    assert acc.Scalars("final/loss/train")[0].value == pytest.approx(losses[4], rel=1e-6)
    text = acc.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"hyper.learning_rate": 0.003' in text and '"model": "tiny-llama"' in text
    assert "_hparams_/experiment" in acc.Tags()["tensors"] or acc.summary_metadata  # HParams plugin data

    files = glob.glob(str(workspace / "tb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    records = wandb_records(Path(files[0]))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "rh" and list(run.tags) == ["t1"] and run.display_name == "job-tb"
    config_values = {u.key: json.loads(u.value_json) for u in run.config.update}
    sha = hashlib.sha256((workspace / "train.jsonl").read_bytes()).hexdigest()
    assert config_values["dataset_sha256"] == sha and config_values["dataset"] == "train.jsonl"
    assert config_values["method.lora_r"] == 4 and config_values["model"] == "tiny-llama"
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            item = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            if "loss/train" in item:
                history[item["trainer/step"]] = item["loss/train"]
    assert history == pytest.approx(losses, rel=1e-6)
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(
                {"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in r.summary.update}
            )
    assert summary["status"] == "succeeded" and summary["loss/train"] == pytest.approx(losses[4], rel=1e-6)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on a local port (``tests.engine.mlflow_server``)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    try:
        server.wait()
        yield server.url
    finally:
        server.stop()


@pytest.mark.slow
def test_a_real_mlflow_server_gets_params_metrics_and_the_adapter(
    workspace: Path, mlflow_server: str
) -> None:
    from mlflow import MlflowClient

    tracking = {"mlflow": {"tracking_uri": mlflow_server, "experiment": "sweep-a", "log_adapter": True}}
    sink = ListSink()
    options = TrackingOptions(name="job-ml", dataset="arith", tags={"roundhouse.job": "j1"})
    result = train(config(workspace, "ml", tracking), sink, tracking=options)
    assert result.status == "succeeded"
    assert not [e for e in sink.events if e[0] == "tracker"], sink.events

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("sweep-a")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "job-ml" and run.info.status == "FINISHED"
    assert run.data.params["hyper.learning_rate"] == "0.003" and run.data.params["method.lora_r"] == "4"
    sha = hashlib.sha256((workspace / "train.jsonl").read_bytes()).hexdigest()
    assert run.data.tags["dataset"] == "arith" and run.data.tags["dataset_sha256"] == sha
    assert run.data.tags["model"] == "tiny-llama" and run.data.tags["roundhouse.job"] == "j1"
    losses = {step: m["loss/train"] for step, m in sink.records if "loss/train" in m}
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss/train")}
    assert history == pytest.approx(losses, rel=1e-6)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss/val")] == [2, 4]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= artifacts
    assert not any("state" in a for a in artifacts)

    # a resumed run (the same folder, more steps) logs to the same MLflow run
    train(config(workspace, "ml", tracking, steps=6), ListSink(), tracking=options)
    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id
    assert max(m.step for m in client.get_metric_history(run.info.run_id, "loss/train")) == 6


def test_a_file_store_gets_the_run(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``file:`` tracking URI (allowed by the URI rules) logs to MLflow's file store, which MLflow 3
    refuses unless MLFLOW_ALLOW_FILE_STORE opts in: the tracker opts in for such a URI."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset below; restored after the test")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    uri = f"file:{workspace / 'mlruns'}"
    sink = ListSink()
    result = train(config(workspace, "ml-file", {"mlflow": {"tracking_uri": uri}}, steps=2), sink)
    assert result.status == "succeeded"
    assert not [e for e in sink.events if e[0] == "tracker"], sink.events
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("roundhouse").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["method.lora_r"] == "4"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss/train")] == [1, 2]


def test_a_tracker_that_is_down_neither_fails_nor_slows_the_run(workspace: Path) -> None:
    port = free_port()  # nothing listens there
    tracking = {"mlflow": {"tracking_uri": f"http://127.0.0.1:{port}"}}
    policy = RetryPolicy(first_pause_s=0.05, max_pause_s=0.1, close_s=3.0)
    secrets = TrackerSecrets(mlflow_token="s3cr3t-token", wandb_api_key="k3y")
    sink = ListSink()
    started = time.monotonic()
    result = train(
        config(workspace, "down", tracking, steps=2), sink, tracking=TrackingOptions(secrets, policy=policy)
    )
    took = time.monotonic() - started
    assert result.status == "succeeded" and result.step == 2
    warnings = [e for e in sink.events if e[0] == "tracker"]
    assert warnings and all(e[2]["tracker"] == "mlflow" and e[2]["level"] == "warning" for e in warnings)
    assert any("retrying in the background" in e[1] for e in warnings)
    # nothing lost: every point waits in the spool file for a resumed run
    (kept,) = [e for e in warnings if "spooled" in e[2]]
    assert kept[2]["spooled"] == len(sink.records) and kept[2]["steps"] == "1-2"
    assert "not delivered by the run's end are kept in tracker-spool/mlflow.jsonl" in kept[1]
    spool = workspace / "down" / "tracker-spool" / "mlflow.jsonl"
    spooled = [json.loads(line)["step"] for line in spool.read_text().splitlines()]
    assert spooled == [step for step, _ in sink.records]
    assert took < 60
    text = repr(sink.events) + repr(sink.records) + repr(secrets) + repr(TrainConfig.model_fields)
    assert "s3cr3t" not in text and "k3y" not in text


def mlflow_config(uri: str) -> TrainConfig:
    return TrainConfig.parse({"data": {"train": "x.jsonl"}, "tracking": {"mlflow": {"tracking_uri": uri}}})


@pytest.mark.parametrize(
    "uri",
    [
        "http://user:pass@mlflow.local:5000",
        "ftp://mlflow.local",
        "databricks",
        "http://mlflow.local:5000/?token=abc",
        "http://mlflow.local:5000/api?",
        "https://mlflow.local/#abc",
        "file:/srv/mlruns?token=abc",
        "https://",
        "https:///mlruns",
        "http://:5000",
        "http://mlflow.local:99999",
        "http://mlflow local",
        "file:",
        "file://other-host/srv/mlruns",
        "file:///srv/../etc",
        "file:/srv/%2e%2e/etc",
        "file:/srv/mlruns%00",
    ],
)
def test_tracking_uris_with_credentials_queries_no_host_or_other_schemes_are_refused(uri: str) -> None:
    with pytest.raises(ConfigError) as err:
        mlflow_config(uri)
    assert err.value.field == "tracking.mlflow.tracking_uri"


@pytest.mark.parametrize(
    "uri",
    [
        "http://127.0.0.1:5000",
        "https://mlflow.example.com/prefix",
        "http://[::1]:5000",
        "file:/srv/mlruns",
        "file:///srv/mlruns",
        "file://localhost/srv/mlruns",
        "file:mlruns",
        "file:../mlruns",  # a run file's own business: the service bounds it to its home
    ],
)
def test_http_uris_to_a_host_and_file_paths_are_tracking_uris(uri: str) -> None:
    assert mlflow_config(uri).tracking.mlflow is not None


def test_a_refused_tracking_uri_is_named_without_its_secret() -> None:
    for uri, secret in [
        ("http://mlflow.local:5000/?token=tok-s3cr3t", "tok-s3cr3t"),
        ("http://user:pw-s3cr3t@mlflow.local:5000", "pw-s3cr3t"),
    ]:
        with pytest.raises(ConfigError) as err:
            mlflow_config(uri)
        assert secret not in str(err.value) and "mlflow.local" in str(err.value)


def test_a_trackers_failure_is_told_without_the_secrets_in_its_urls(tmp_path: Path) -> None:
    warnings: list[tuple[str, dict]] = []
    policy = RetryPolicy(first_pause_s=0.01, max_pause_s=0.01, close_s=0.2)
    said = "request to https://u:pw-s3cr3t@mlflow.local/api?token=tok-s3cr3t failed, url: /api/x?key=k-s3cr3t"

    def refuse() -> None:
        raise ConnectionError(said)

    bg = Background(
        "mlflow",
        start=refuse,
        send=lambda points: None,
        spool=tmp_path / "mlflow.jsonl",
        warn=lambda m, d: warnings.append((m, d)),
        policy=policy,
    )
    assert bg.close() is False
    text = repr(warnings)
    assert "start failed" in text and "https://***@mlflow.local/api?***" in text
    assert "s3cr3t" not in text


def test_the_engine_imports_no_tracker_until_a_run_asks() -> None:
    code = "import engine.tracking, engine.training.run, sys; print({'wandb', 'mlflow'} & set(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "set()"


def test_a_hung_tracker_costs_the_run_no_time_but_the_bounded_close(tmp_path: Path) -> None:
    hang = threading.Event()
    warnings: list[tuple[str, dict]] = []
    policy = RetryPolicy(first_pause_s=0.01, queue=100, close_s=0.5)
    spool = tmp_path / "tracker-spool" / "slow.jsonl"
    bg = Background(
        "slow",
        start=hang.wait,  # a server that never answers
        send=lambda points: None,
        spool=spool,
        warn=lambda m, d: warnings.append((m, d)),
        policy=policy,
    )
    started = time.monotonic()
    for step in range(1000):
        bg.log(Point(step, {"loss/train": 1.0}, 1_700_000_000_000 + step))
    assert time.monotonic() - started < 0.5  # queued, never waited for
    assert len(bg.spool.memory) == 100  # bounded: the other 900 wait in the file
    started = time.monotonic()
    assert bg.close() is False
    assert time.monotonic() - started < 1.5
    messages = [m for m, _ in warnings]
    spilled = "slow: 100 points wait in memory: from step 100 on they wait in tracker-spool/slow.jsonl"
    assert messages[0].startswith(spilled)
    assert re.search(r"1000 point\(s\) \(steps 0-999\) not delivered by the run's end", messages[-1])
    lines = spool.read_text().splitlines()
    assert [Point.parse(line).step for line in lines] == list(range(1000))
    hang.set()
