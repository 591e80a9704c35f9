"""What used to mislead: the plan of a CPU host and its ETA from the data's real token counts,
``/docs`` offline, exports that name their real base model (one top folder, a README, real
mtimes), merged builds cached once and cleared, and the login link of ``keys create`` (the settings'
table is generated: docs/reference/settings.md, checked by tests/docs/test_reference.py)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.planner import CPU_GFLOPS_PER_CORE, batch_length
from server.services import gpus
from server.settings import Settings
from tests.server.test_checkpoints import adapter_checkpoint, verified
from tests.utils import child_env, roundhouse


def upload(client: TestClient, rows: list[Any]) -> Any:
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    r = client.post("/api/datasets", files={"file": ("train.jsonl", content)})
    assert r.status_code == 201, r.text
    return r.json()


def cpu_worker(client: TestClient, *, cores: float = 2.0) -> None:
    """A worker's telemetry as a host without GPUs reports it (``server/worker/telemetry.py``)."""
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        gpus.record(
            session,
            worker_id="w@cpu-box",
            hostname="cpu-box",
            devices=[],
            cpu={"utilization": 5.0, "memory_total": 24e9, "cores": cores},
            message="no GPU on this host",
        )


PLAN = {
    "base_model": "demo",
    "data": {"max_length": 1024},
    "hyper": {"batch_size": 8, "max_steps": 30},
    "engine": {"num_microbatches": 4},
}


def test_a_cpu_host_is_planned_as_one_cpu_worker_at_a_measured_rate(client: TestClient) -> None:
    gpu_default = client.post("/api/plan", json=PLAN).json()  # no worker online: 2 GPUs assumed
    assert gpu_default["assumptions"]["device"] == "gpu"
    assert gpu_default["assumptions"]["hardware"] == "2 GPUs of 24 GB"
    cpu_worker(client, cores=2.0)
    plan = client.post("/api/plan", json=PLAN).json()
    a = plan["assumptions"]
    assert a["device"] == "cpu" and a["hardware"] == "CPU host (no GPU reported)"
    assert "no GPU" in a["detected"] and "CPU cores" in a["detected"]
    assert a["gpu_tflops"] == pytest.approx(2 * CPU_GFLOPS_PER_CORE / 1000)
    assert plan["fits"] and plan["partition"].count("[") == 1  # one worker, one stage
    # the demo's LoRA measured ~190 tokens/s on 2 cores; the GPU plan said ~100,000
    assert 100 < plan["tokens_per_s"] < 400, plan["tokens_per_s"]
    assert gpu_default["tokens_per_s"] > 100 * plan["tokens_per_s"]
    assert plan["eta_s"] == pytest.approx(plan["iteration_s"] * 30)
    # naming GPUs plans them, whatever the workers report
    named = client.post("/api/plan", json=PLAN | {"hardware": {"num_gpus": 2}}).json()
    assert named["assumptions"]["device"] == "gpu"


def test_the_eta_comes_from_the_datasets_real_token_counts(client: TestClient, settings: Settings) -> None:
    from engine.data.encode import encode
    from engine.data.read import read_records, to_example
    from engine.model.loading import load_tokenizer

    cpu_worker(client)
    rows = [
        {
            "messages": [
                {"role": "user", "content": "count " * (1 + i % 7)},
                {"role": "assistant", "content": "3"},
            ]
        }
        for i in range(40)
    ]
    ds = upload(client, rows)
    body = PLAN | {"base_model": "tiny", "dataset_id": ds["id"], "hyper": {"batch_size": 8, "epochs": 1}}
    plan = client.post("/api/plan", json=body).json()
    a = plan["assumptions"]
    tokenizer = load_tokenizer(settings.models_dir / "tiny")
    path = next(settings.datasets_dir.rglob("*.jsonl"))
    lengths = [encode(to_example(n, r, "chat"), tokenizer, 1 << 30).length for n, r in read_records(path)]
    assert a["tokens_from_data"] is True
    assert a["tokens_per_sequence"] == pytest.approx(
        batch_length(lengths, batch_size=8, max_length=1024, packing=False)
    )
    assert a["tokens_per_sequence"] <= max(lengths) < 200  # short rows, not max_length
    # against the same plan assuming every row is max_length long: far shorter
    blind = client.post("/api/plan", json=body | {"dataset_id": None, "hyper": {"max_steps": 5}}).json()
    assert blind["assumptions"]["tokens_from_data"] is False
    assert blind["assumptions"]["tokens_per_sequence"] == 1024
    assert plan["eta_s"] == pytest.approx(plan["iteration_s"] * 5)  # 40 rows // 8 per batch
    assert plan["iteration_s"] < blind["iteration_s"] / 5
    # cut at max_length: the lengths the run trains on
    short = client.post("/api/plan", json=body | {"data": {"max_length": 8}}).json()
    assert short["assumptions"]["tokens_per_sequence"] == 8


def test_docs_and_redoc_use_only_local_assets(client: TestClient) -> None:
    for page in ("/docs", "/redoc"):
        r = client.get(page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", r.text)
        assert urls, r.text
        assert all(u.startswith("/") or u.startswith("data:") for u in urls), urls
        for url in (u for u in urls if u.startswith("/docs/assets/")):
            asset = client.get(url)
            kind = "text/css" if url.endswith(".css") else "text/javascript"
            assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind), url
            assert len(asset.content) > 100_000
    assert "http" not in client.get("/docs").text.replace("/openapi.json", "")
    assert client.get("/docs/assets/nope.js").status_code == 404
    client.headers.pop("Authorization")
    assert client.get("/docs").status_code == 401


def test_base_model_names_are_hub_ids_not_server_paths(tmp_path: Path) -> None:
    from engine.model.export import DEMO_HUB_NAME, base_model_name

    assert DEMO_HUB_NAME == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_name("demo", "/srv/data/models/smollm2-135m-instruct") == DEMO_HUB_NAME
    assert base_model_name(None, tmp_path / "models" / "smollm2-135m-instruct") == DEMO_HUB_NAME
    cached = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    assert base_model_name("Qwen/Qwen3-0.6B", cached) == "Qwen/Qwen3-0.6B"
    assert base_model_name(None, cached) == "Qwen/Qwen3-0.6B"
    folder = tmp_path / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "meta-llama/Llama-3.2-1B"}))
    assert base_model_name("my-llama", folder) == "meta-llama/Llama-3.2-1B"
    (folder / "config.json").write_text(json.dumps({"_name_or_path": str(folder)}))
    assert base_model_name("my-llama", folder) == "my-llama"
    assert base_model_name(str(folder), folder) == "my-llama"  # never a path


def members(archive: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return tar.getmembers()


def read_member(archive: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        found = tar.extractfile(name)
        assert found is not None, name
        return found.read()


def test_an_adapter_download_names_its_base_has_one_folder_and_a_readme(
    client: TestClient, settings: Settings
) -> None:
    job_id, step = adapter_checkpoint(client, settings)
    folder = next(settings.runs_dir.glob(f"*/checkpoints/step_{step:06d}"))
    config = json.loads((folder / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(settings.models_dir / "tiny")  # as older exports did
    (folder / "adapter_config.json").write_text(json.dumps(config))
    r = client.get(f"/api/jobs/{job_id}/checkpoints/{step}/download")
    assert r.status_code == 200
    top = f"{job_id[:8]}-step{step:06d}-adapter"
    assert r.headers["content-disposition"] == f'attachment; filename="{top}.tar"'
    every = members(r.content)
    assert {m.name.split("/")[0] for m in every} == {top} and every[0].isdir()
    assert all(m.mtime > 1e9 for m in every)  # real times, not the epoch
    manifest = verified(r.content)
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors"} <= set(manifest)
    recorded = json.loads(read_member(r.content, f"{top}/adapter_config.json"))
    assert recorded["base_model_name_or_path"] == "tiny"  # the model's name, not a server path
    readme = read_member(r.content, f"{top}/README.md").decode()
    assert "AutoPeftModelForCausalLM" in readme and "`tiny`" in readme and top in readme


def test_a_merged_build_is_kept_once_and_can_be_cleared(client: TestClient, settings: Settings) -> None:
    job_id, step = adapter_checkpoint(client, settings)
    url = f"/api/jobs/{job_id}/checkpoints/{step}/download"
    first = client.get(url, params={"merged": True})
    assert first.status_code == 200
    exports = next(settings.runs_dir.glob("*/exports"))
    built = sorted(p.name for p in exports.iterdir() if not p.name.startswith("."))
    assert built == [f"{job_id[:8]}-step{step:06d}-merged.tar"]  # the archive only, no model folder
    archive = exports / built[0]
    stamp = archive.stat().st_mtime_ns
    again = client.get(url, params={"merged": True})
    assert again.content == first.content and archive.stat().st_mtime_ns == stamp  # reused
    top = built[0].removesuffix(".tar")
    manifest = verified(first.content)
    assert "config.json" in manifest and "README.md" in manifest
    readme = read_member(first.content, f"{top}/README.md").decode()
    assert "AutoModelForCausalLM" in readme and "merged" in readme
    (exports / f"step_{step:06d}-merged").mkdir()  # an older version's merged folder
    (exports / f"step_{step:06d}-merged" / "model.safetensors").write_bytes(b"m" * 100)
    assert client.delete(f"/api/jobs/{job_id}/checkpoints/{step}/merged").status_code == 204
    assert not archive.exists() and not (exports / f"step_{step:06d}-merged").exists()
    assert client.delete(f"/api/jobs/{job_id}/checkpoints/{step}/merged").status_code == 204  # idempotent
    r = client.delete(f"/api/jobs/{job_id}/checkpoints/99/merged")
    assert r.status_code == 404 and r.json()["error"]["param"] == "step"
    rebuilt = client.get(url, params={"merged": True})
    assert rebuilt.status_code == 200 and archive.is_file()
    # the adapter's own download is not a merged build: clearing leaves it
    assert client.get(url).status_code == 200
    client.delete(f"/api/jobs/{job_id}/checkpoints/{step}/merged")
    assert [p.name for p in exports.glob("*.tar")] == [f"{job_id[:8]}-step{step:06d}-adapter.tar"]


def test_keys_create_prints_the_link_of_the_configured_port(settings: Settings) -> None:
    env = child_env(**settings.child_environment(), ROUNDHOUSE_PORT="8123", ROUNDHOUSE_HOST="0.0.0.0")
    done = subprocess.run(roundhouse("keys", "create"), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "login URL: http://127.0.0.1:8123/login?token=rhl_" in done.stderr


def test_the_login_link_is_boxed() -> None:
    from server.cli import boxed

    text = boxed(["Roundhouse is up. Open: http://h:1/login?token=rhl_x", "(note)"])
    lines = text.strip("\n").splitlines()
    assert lines[0] == lines[-1] and set(lines[0]) == {"+", "="}
    assert all(len(line) == len(lines[0]) and line.startswith("|") for line in lines[1:-1])
    assert re.search(r"Open: (http://\S+/login\?token=(rhl_\S+))", text).group(2) == "rhl_x"  # type: ignore[union-attr]
