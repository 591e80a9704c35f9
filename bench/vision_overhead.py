"""Engine overhead on a vision-language model: tokens/s and peak RSS of RoundPipe (1 CPU worker,
sync, fp32) vs a plain loop on the unsplit model, beside the same measurement for the text model
alone.

The VLM has the SmolVLM/Idefics3 layout: a 4-layer SigLIP tower (192 wide, 64x64 images in 8x8
patches), its connector (pixel shuffle, 16 tokens per image) and the Llama language model of
``bench/engine_overhead.py`` (6 blocks x 256, sequence 256, batch 16), randomly initialised. Each
row holds 4 images (64 of its 256 tokens are image tokens); the tower and the projector train.
The text variants train the same language model on text rows of the same length. Every
measurement runs in its own child process, the variants alternating, repeated; medians and the
engine/plain ratios go to bench/results/vision_overhead.json.

    python bench/vision_overhead.py [--steps 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from engine_overhead import timed  # bench/ is on the path when a bench runs as a script

RESULTS = Path(__file__).resolve().parent / "results"
BLOCKS, HIDDEN, SEQ, BATCH, VOCAB = 6, 256, 256, 16, 8192
IMAGES, IMAGE_SIZE, PATCH, TOKENS = 4, 64, 8, 16  # per row; (64/8)^2 = 64 patches -> 16 tokens
IMAGE_TOKEN = VOCAB - 1
VARIANTS = ("text-plain", "text-engine-m1", "vlm-plain", "vlm-engine-m1", "vlm-engine-m4")


def build(vlm: bool) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """The model, the plain loop's batches and the engine's (the same data)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=688,
        num_hidden_layers=BLOCKS,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    if vlm:
        config = Idefics3Config(
            text_config=dict(text, model_type="llama"),
            vision_config=dict(
                hidden_size=192,
                intermediate_size=768,
                num_hidden_layers=4,
                num_attention_heads=4,
                image_size=IMAGE_SIZE,
                patch_size=PATCH,
            ),
            scale_factor=2,
            image_token_id=IMAGE_TOKEN,
            tie_word_embeddings=False,
        )
        model = Idefics3ForConditionalGeneration(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**text))
    model.train()
    g = torch.Generator().manual_seed(1)
    plain, engine = [], []
    for _ in range(4):
        ids = torch.randint(0, VOCAB - 1, (BATCH, SEQ), generator=g)
        if not vlm:
            plain.append({"input_ids": ids, "labels": ids.clone()})
            engine.append(plain[-1])
            continue
        for i in range(IMAGES):  # each image's tokens at a fixed place in every row
            start = 8 + i * (TOKENS + 40)
            ids[:, start : start + TOKENS] = IMAGE_TOKEN
        labels = ids.clone()
        labels[ids == IMAGE_TOKEN] = -100
        pixels = torch.randn(BATCH, IMAGES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
        mask = torch.ones(BATCH, IMAGES, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.long)
        plain.append(
            {"input_ids": ids, "labels": labels, "pixel_values": pixels, "pixel_attention_mask": mask}
        )
        rows = [{"pixel_values": pixels[r], "pixel_attention_mask": mask[r]} for r in range(BATCH)]
        engine.append({"input_ids": ids, "labels": labels, "images": rows})
    return model, plain, engine


def child(variant: str, steps: int) -> dict[str, Any]:
    import torch

    model, plain_batches, engine_batches = build(variant.startswith("vlm"))
    warmup = 2
    finish = None
    rp = None
    if variant.endswith("plain"):
        batches = plain_batches
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

        def train_step(batch: dict[str, Any]) -> None:
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()

    else:
        from engine import EngineConfig, RoundPipe

        batches = engine_batches
        microbatches = int(variant.split("-m")[1])
        rp = RoundPipe(model, EngineConfig(devices=["cpu"], num_microbatches=microbatches, lr=1e-4))

        def train_step(batch: dict[str, Any]) -> None:
            rp.forward_backward(**batch)
            rp.step()

        finish = rp.synchronize
    seconds = timed(train_step, batches, steps, finish, warmup=warmup)
    out = {
        "variant": variant,
        "tokens_per_s": steps * BATCH * SEQ / seconds,
        "seconds_per_step": seconds / steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if rp is not None:
        out["plan"] = rp.plan.describe() if rp.plan else None
        rp.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=VARIANTS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(args.repeats):
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps)]
            env = os.environ | {"HF_HUB_OFFLINE": "1"}
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            runs[variant].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(
                f"repeat {r}: {variant:14s} {runs[variant][-1]['tokens_per_s']:8.0f} tok/s  "
                f"peak RSS {runs[variant][-1]['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    import torch
    import transformers

    med = {v: statistics.median(x["tokens_per_s"] for x in runs[v]) for v in runs}
    rss = {v: statistics.median(x["peak_rss_mb"] for x in runs[v]) for v in runs}
    ratios = {
        "text-engine-m1": med["text-engine-m1"] / med["text-plain"],
        "vlm-engine-m1": med["vlm-engine-m1"] / med["vlm-plain"],
        "vlm-engine-m4": med["vlm-engine-m4"] / med["vlm-plain"],
    }
    result = {
        "benchmark": "vision_overhead",
        "model": (
            f"Idefics3 layout: SigLIP 4 x 192 ({IMAGE_SIZE}px, patch {PATCH}), connector, "
            f"Llama {BLOCKS} x {HIDDEN}, vocab {VOCAB}; text variants: the Llama alone"
        ),
        "sequence": SEQ,
        "batch": BATCH,
        "images_per_row": IMAGES,
        "image_tokens_per_row": IMAGES * TOKENS,
        "steps": args.steps,
        "repeats": args.repeats,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "tokens_per_s": med,
        "peak_rss_mb": rss,
        "throughput_ratio_over_plain": ratios,
        "rss_ratio_over_plain": {
            "text-engine-m1": rss["text-engine-m1"] / rss["text-plain"],
            "vlm-engine-m1": rss["vlm-engine-m1"] / rss["vlm-plain"],
            "vlm-engine-m4": rss["vlm-engine-m4"] / rss["vlm-plain"],
        },
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "vision_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    for v, ratio in ratios.items():
        print(
            f"{v} / plain: tokens/s ratio {ratio:.3f}, peak RSS ratio {result['rss_ratio_over_plain'][v]:.3f}"
        )


if __name__ == "__main__":
    main()
