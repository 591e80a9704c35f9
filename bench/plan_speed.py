"""How long ``POST /api/plan`` takes: the paper's five models from their config shapes, and models
of 256 decoder blocks (the deepest a plan takes) of each kind of block.

The service runs in this process (``server.app.create_app`` on a fresh SQLite folder, no worker,
FastAPI's test client): a request is the whole route, from the JSON body through the job's
``TrainConfig``, the hardware, the planner (partition, simulated iteration, longest sequence; a
LoRA job's 16-bit and 4-bit base side by side) to the JSON answer. Each model is planned in four
settings of the new-job page: LoRA on a host whose RAM limits the sequence (128 GB) and on a
roomy one (512 GB), a full fine-tune (512 GB), and LoRA with a 4-bit base (128 GB), all on 8 GPUs
of 24 GB at 2048 tokens a sequence, batch 16 in 16 micro-batches.

Latency is the client's wall time per request. ``warm``: the same request again (what the
new-job page sends while one field changes); ``cold``: the planner's per-shape caches cleared
before each request (a model planned for the first time). Per model: p50 and p95 over every
request of its four settings; the target is p95 <= 300 ms.

``--before REV`` also measures the planner of git revision REV (a temporary worktree, the same
requests, fewer repeats: it took seconds a request) in a child process, and records whether
each setting got the same partition and iteration time from both.

    python bench/plan_speed.py [--repeats 9] [--before 4df99a8] [--before-repeats 2]

Results: ``bench/results/plan_speed.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGET_MS = 300.0

# the config.json sizes of the paper's five models
QWEN3_1_7B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "attention_bias": True,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
QWEN3_32B = QWEN3_1_7B | {
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "tie_word_embeddings": False,
}
QWEN3_235B_A22B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
}
DEEP = 256
MODELS: dict[str, dict[str, Any]] = {
    "Qwen3-1.7B": QWEN3_1_7B,
    "Llama-3.1-8B": LLAMA_3_1_8B,
    "GPT-OSS-20B": GPT_OSS_20B,
    "Qwen3-32B": QWEN3_32B,
    "Qwen3-235B-A22B": QWEN3_235B_A22B,
    f"Llama-3.1-8B x{DEEP} blocks": LLAMA_3_1_8B | {"num_hidden_layers": DEEP},
    f"Qwen3-32B x{DEEP} blocks": QWEN3_32B | {"num_hidden_layers": DEEP},
    f"GPT-OSS-20B x{DEEP} blocks": GPT_OSS_20B | {"num_hidden_layers": DEEP},
    f"Qwen3-235B-A22B x{DEEP} blocks": QWEN3_235B_A22B | {"num_hidden_layers": DEEP},
    f"DeepSeek-V3 x{DEEP} blocks": DEEPSEEK_V3 | {"num_hidden_layers": DEEP},
}
PAPER = tuple(list(MODELS)[:5])
SETTINGS: dict[str, dict[str, Any]] = {
    "lora-128GB": {"method": {"kind": "lora"}, "host_ram_gb": 128},
    "lora-512GB": {"method": {"kind": "lora"}, "host_ram_gb": 512},
    "full-512GB": {"method": {"kind": "full"}, "host_ram_gb": 512},
    "lora-4bit-128GB": {"method": {"kind": "lora", "base_bits": 4}, "host_ram_gb": 128},
}


def request_body(config: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any]:
    return {
        "config": config,
        "data": {"max_length": 2048},
        "method": setting["method"],
        "hyper": {"batch_size": 16, "max_steps": 1000},
        "engine": {"num_microbatches": 16},
        "hardware": {"num_gpus": 8, "gpu_memory_gb": 24, "host_ram_gb": setting["host_ram_gb"]},
    }


def clear_caches() -> None:
    """Forget every per-shape result the planner keeps (a model planned for the first time)."""
    import functools

    import engine.planner as planner

    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if not name.startswith(planner.__name__):
            continue
        for value in vars(module).values():
            if isinstance(value, functools._lru_cache_wrapper):
                value.cache_clear()


def measure(repeats: int, models: list[str]) -> dict[str, Any]:
    """Every setting of every model: ``repeats`` cold and ``repeats`` warm requests."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(home=Path(tmp) / "home", hub_offline=True, queue="plan-speed")
        app = create_app(settings)
        with TestClient(app) as client:
            client.headers["Authorization"] = f"Bearer {app.state.first_key}"
            client.post("/api/plan", json=request_body(QWEN3_1_7B, SETTINGS["lora-512GB"]))  # imports
            for name in models:
                runs: dict[str, Any] = {}
                for label, setting in SETTINGS.items():
                    body = request_body(MODELS[name], setting)
                    times: dict[str, list[float]] = {"cold": [], "warm": []}
                    answer: dict[str, Any] = {}
                    for kind in ("cold", "warm"):
                        for _ in range(repeats):
                            if kind == "cold":
                                clear_caches()
                            gc.collect()
                            start = time.perf_counter()
                            r = client.post("/api/plan", json=body)
                            times[kind].append(1000 * (time.perf_counter() - start))
                            if r.status_code != 200:
                                raise RuntimeError(f"{name} {label}: {r.status_code} {r.text}")
                            answer = r.json()
                    runs[label] = {
                        "ms": times,
                        "fits": answer["fits"],
                        "partition": answer["partition"],
                        "slots": len(answer["stages"]),
                        "iteration_s": answer["iteration_s"],
                        "max_seq_len": answer["max_seq_len"],
                        "max_seq_len_limit": answer["max_seq_len_limit"],
                        "host_ram_gb": answer["host_ram"]["total_gb"],
                        "base_variants": answer.get("base_variants", []),
                    }
                    print(
                        f"{name:30s} {label:16s} cold {statistics.median(times['cold']):8.1f} ms  warm "
                        f"{statistics.median(times['warm']):8.1f} ms  slots {runs[label]['slots']:3d}  "
                        f"longest {answer['max_seq_len']} ({answer['max_seq_len_limit']})",
                        flush=True,
                    )
                out[name] = runs
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def summary(runs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, settings in runs.items():
        every = [t for s in settings.values() for kind in ("cold", "warm") for t in s["ms"][kind]]
        cold = [t for s in settings.values() for t in s["ms"]["cold"]]
        out[name] = {
            "p50_ms": round(percentile(every, 50), 2),
            "p95_ms": round(percentile(every, 95), 2),
            "cold_p95_ms": round(percentile(cold, 95), 2),
            "max_ms": round(max(every), 2),
            "requests": len(every),
        }
    return out


def run_before(rev: str, repeats: int, models: list[str]) -> dict[str, Any]:
    """The same requests against revision ``rev``'s service, in a child process on a worktree."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
        try:
            result = Path(tmp) / "before.json"
            command = [sys.executable, str(Path(__file__).resolve()), "--measure-only", str(result)]
            command += ["--repeats", str(repeats), "--models", *models]
            env = os.environ | {"PYTHONPATH": str(tree), "PLAN_SPEED_ROOT": str(tree)}
            subprocess.run(command, check=True, cwd=tree, env=env)
            return dict(json.loads(result.read_text()))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)


def _editable_finder(finder: Any) -> bool:
    """Whether ``finder`` is the import hook of a pip editable install."""
    module = finder.__module__ if isinstance(finder, type) else type(finder).__module__
    return module.startswith("__editable__")


def machine() -> dict[str, Any]:
    import fastapi

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return {
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "fastapi": fastapi.__version__,
        "commit": commit.stdout.strip(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="cold and warm requests per setting")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--before", help="also measure this git revision (e.g. the commit before a change)")
    parser.add_argument("--before-repeats", type=int, default=2)
    parser.add_argument("--before-models", nargs="*", default=list(PAPER))
    parser.add_argument("--measure-only", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_speed.json")
    args = parser.parse_args()
    root = Path(os.environ.get("PLAN_SPEED_ROOT", ROOT))
    if root != ROOT:
        # another revision's tree: its packages, not those an editable install of this checkout
        # maps in (its finder on sys.meta_path would win over sys.path)
        sys.meta_path[:] = [f for f in sys.meta_path if not _editable_finder(f)]
    sys.path.insert(0, str(root))
    if root != ROOT:
        import engine

        if not Path(engine.__file__).resolve().is_relative_to(root.resolve()):
            raise SystemExit(f"plan_speed: measuring {root} imported the engine of {engine.__file__}")
    if args.measure_only:
        args.measure_only.write_text(json.dumps(measure(args.repeats, args.models)))
        return
    runs = measure(args.repeats, args.models)
    after = summary(runs)
    result: dict[str, Any] = {
        "what": "POST /api/plan wall time in the client, in-process service on SQLite, no worker",
        "target_p95_ms": TARGET_MS,
        "settings": {k: request_body({"...": "model"}, v) for k, v in SETTINGS.items()},
        "repeats": args.repeats,
        "machine": machine(),
        "after": after,
        "after_meets_target": all(s["p95_ms"] <= TARGET_MS for s in after.values()),
        "runs": runs,
    }
    if args.before:
        old = run_before(args.before, args.before_repeats, args.before_models)
        result["before_revision"] = args.before
        result["before"] = summary(old)
        result["before_runs"] = old
        same = {}
        for name, settings in old.items():
            same[name] = {
                label: {
                    "same_partition": runs[name][label]["partition"] == s["partition"],
                    "iteration_s_after_over_before": runs[name][label]["iteration_s"] / s["iteration_s"]
                    if s["iteration_s"]
                    else None,
                }
                for label, s in settings.items()
            }
        result["before_vs_after"] = same
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"after": after, "before": result.get("before")}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
