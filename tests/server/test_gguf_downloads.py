"""A checkpoint downloaded as a GGUF folder for llama.cpp and Ollama: built once, kept, refused
with the field named."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import gguf
from fastapi.testclient import TestClient

from server.services import checkpoints
from server.settings import Settings
from tests.utils.jobs import start_job


def adapter_checkpoint(client: TestClient, settings: Settings) -> tuple[str, int]:
    """A job with one real LoRA checkpoint of the tiny model, recorded as the worker records it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    content = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8)).encode()
    ds = client.post("/api/datasets", files={"file": ("rows.jsonl", content)}).json()
    job = start_job(client, ds["id"])
    folder = Path(job["config"]["output_dir"]) / "checkpoints" / "step_000002"
    base = settings.models_dir / "tiny"
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    (folder / "state").mkdir()
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        checkpoints.record(session, job_id=job["id"], step=2, path=str(folder), kind="adapter", metrics={})
    return job["id"], 2


def members(body: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_gguf_download_is_built_once(client: TestClient, settings: Settings, tmp_path: Path) -> None:
    job_id, step = adapter_checkpoint(client, settings)
    url = f"/api/jobs/{job_id}/checkpoints/{step}/download"
    first = client.get(url, params={"gguf": "q8_0"})
    assert first.status_code == 200, first.text
    assert first.headers["content-disposition"].endswith(f'-step{step:06d}-gguf-q8_0.tar"')
    files = members(first.content)
    assert {"model-q8_0.gguf", "adapter-f32.gguf", "Modelfile", "README.md", "MANIFEST.sha256"} <= set(files)
    assert files["Modelfile"].decode().splitlines()[1] == "FROM ./model-q8_0.gguf"
    (tmp_path / "m.gguf").write_bytes(files["model-q8_0.gguf"])
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert reader.fields["general.architecture"].contents() == "llama"
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q8_0", "F32"}
    built = list(Path(settings.home).rglob("*-gguf-q8_0.tar"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    again = client.get(url, params={"gguf": "q8_0"})
    assert again.content == first.content and built[0].stat().st_mtime_ns == stamp


def test_gguf_download_refusals_name_the_field(client: TestClient, settings: Settings) -> None:
    job_id, step = adapter_checkpoint(client, settings)
    url = f"/api/jobs/{job_id}/checkpoints/{step}/download"
    bad = client.get(url, params={"gguf": "q2_k"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "gguf"
    assert "'q8_0' or 'q4_k_m'" in bad.json()["error"]["message"]
    both = client.get(url, params={"gguf": "f16", "merged": "true"})
    assert both.status_code == 422 and both.json()["error"]["param"] == "gguf"
