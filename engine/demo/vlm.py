"""The vision-language demo: a VLM learns to name the colour of the shape in a picture.

No vision-language model ships in a package the way the text demo model does, so the demo VLM is
assembled from what does: the demo's SmolLM2-135M-Instruct as the language model of a model with
the SmolVLM/Idefics3 layout, in front of a small vision tower (a 2-layer SigLIP encoder, 64x64
images in 8x8 patches) and its connector (pixel shuffle and projection: 16 image tokens per
picture), both newly initialised. Before the fine-tune the model cannot see: what it says about a
picture's colour is a guess. The fine-tune trains the tower and the connector whole and a LoRA
adapter on the language model; the held-out pictures (shapes of other sizes and places) are then
named right. It shows the whole path (image rows, the tower as a pipeline layer, the trained
tower in the adapter's checkpoint, generation with images), not what a pretrained VLM knows.

The pictures are drawn here (``picture``) from a seed: nothing is downloaded.
"""

from __future__ import annotations

import base64
import io
import json
import random
import time
from pathlib import Path
from typing import Any

COLOURS = {
    "red": (215, 35, 35),
    "green": (35, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 210, 40),
    "purple": (130, 50, 170),
    "orange": (240, 130, 30),
}
SHAPES = ("square", "circle", "triangle")
QUESTION = "What colour is the shape in this picture? Answer with one word."
SIZE = 64  # pixels a side
DEMO_VLM_NAME = "smolvlm-colours-demo"
TOKENS_PER_IMAGE = 16  # (64 / 8)^2 patches, pixel shuffle by 2


def picture(colour: str, shape: str, rng: random.Random) -> bytes:
    """A PNG of one shape in ``colour`` on a grey background, of a random size and place."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    side = rng.randint(18, 40)
    x, y = rng.randint(2, SIZE - side - 2), rng.randint(2, SIZE - side - 2)
    box = (x, y, x + side, y + side)
    fill = COLOURS[colour]
    if shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` chat rows in OpenAI's vision format: a picture and the question, the colour as
    the answer; every colour and shape in turn."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        colour = list(COLOURS)[i % len(COLOURS)]
        shape = SHAPES[(i // len(COLOURS)) % len(SHAPES)]
        url = "data:image/png;base64," + base64.b64encode(picture(colour, shape, rng)).decode()
        rows.append(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": QUESTION},
                        ],
                    },
                    {"role": "assistant", "content": colour},
                ]
            }
        )
    return rows


def prepare_demo_vlm(models_dir: str | Path) -> Path:
    """Assemble the demo VLM in ``models_dir/smolvlm-colours-demo`` once (see the module's
    docstring); returns the folder, which ``engine.model.loading.load_model`` loads."""
    import os
    import shutil

    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from engine.model.loading import load_model, load_tokenizer, prepare_demo_model
    from engine.vision.processing import build_processor, save_processor

    target = Path(models_dir) / DEMO_VLM_NAME
    if (target / "config.json").is_file():
        return target
    text_folder = prepare_demo_model(models_dir)
    text_model = load_model(text_folder)
    tokenizer = load_tokenizer(text_folder)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": SIZE}, max_image_size={"longest_edge": SIZE}, do_image_splitting=False
    )
    # the processor adds the Idefics3 image tokens to the tokenizer
    processor = build_processor(
        "Idefics3ForConditionalGeneration", images, tokenizer, image_seq_len=TOKENS_PER_IMAGE
    )
    text_config = text_model.config.to_dict()
    text_config["vocab_size"] = len(processor.tokenizer)
    torch.manual_seed(0)
    config = Idefics3Config(
        text_config=text_config,
        vision_config={
            "hidden_size": 128,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": SIZE,
            "patch_size": 8,
        },
        scale_factor=2,
        image_token_id=processor.image_token_id,
        tie_word_embeddings=bool(text_model.config.tie_word_embeddings),
    )
    model = Idefics3ForConditionalGeneration(config)
    text_model.resize_token_embeddings(len(processor.tokenizer))
    missing = model.model.text_model.load_state_dict(text_model.model.state_dict(), strict=False)
    if missing.missing_keys:
        raise RuntimeError(f"demo VLM: the language model lacks {missing.missing_keys[:3]}")
    with torch.no_grad():
        model.lm_head.weight.copy_(text_model.lm_head.weight)
    model.config._name_or_path = DEMO_VLM_NAME
    tmp = target.with_name(f".{DEMO_VLM_NAME}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    save_processor(processor, "Idefics3ForConditionalGeneration", tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)
    return target


def named_right(model: Any, processor: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy answers to the rows' questions: the share whose first colour word is the answer."""
    import torch

    from engine.inference.images import chat_prompt

    right, samples = 0, []
    for row in rows:
        user, answer = row["messages"][0], row["messages"][1]["content"]
        data = base64.b64decode(user["content"][0]["image_url"]["url"].split(",", 1)[1])
        messages = [
            {
                "role": "user",
                "content": [{"type": "image", "image": data}, {"type": "text", "text": QUESTION}],
            }
        ]
        prompt = chat_prompt(processor.tokenizer, messages, processor=processor)
        ids = torch.tensor([prompt.ids])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                **prompt.inputs,
                max_new_tokens=6,
                do_sample=False,
            )
        said = processor.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        words = [w.strip(".,!").lower() for w in said.split()]
        named = next((w for w in words if w in COLOURS), None)
        right += named == answer
        samples.append({"expected": answer, "said": said})
    return {"right": right, "rows": len(rows), "share": right / max(len(rows), 1), "samples": samples}


def run_demo(
    models_dir: str | Path,
    output_dir: str | Path,
    *,
    steps: int = 30,
    workers: int = 1,
    heldout: int = 24,
    sink: Any = None,
) -> dict[str, Any]:
    """Prepare the demo VLM, measure it on ``heldout`` held-out pictures, fine-tune it, measure
    again."""
    from engine.config import TrainConfig
    from engine.inference.generate import load_for_inference
    from engine.model.loading import load_processor_for
    from engine.training.run import train

    folder = prepare_demo_vlm(models_dir)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_file = out / "colours_train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in make_rows(96, seed=1)))
    pictures = make_rows(heldout, seed=2)
    processor = load_processor_for(folder)
    model, _ = load_for_inference(folder)
    before = named_right(model, processor, pictures)
    config = TrainConfig.parse(
        {
            "model": {"path": str(folder), "name": DEMO_VLM_NAME},
            "data": {"train": str(train_file), "validation_fraction": 0.0, "max_length": 128},
            "method": {
                "tuning": "lora",
                "lora_r": 16,
                "lora_alpha": 32,
                "vision_tower": "full",
                "projector": "full",
            },
            "hyper": {"max_steps": steps, "batch_size": 8, "learning_rate": 2e-3, "warmup_steps": 4},
            "engine": {"devices": ["cpu"] * workers, "num_microbatches": 2},
            "checkpoint": {"every_steps": steps, "keep_last": 1},
            "output_dir": str(out / "run"),
        }
    )
    started = time.perf_counter()
    result = train(config, sink)
    seconds = time.perf_counter() - started
    if result.checkpoint is None:
        raise ValueError("the VLM demo run wrote no checkpoint")
    tuned, _ = load_for_inference(folder, adapter=result.checkpoint)
    after = named_right(tuned, processor, pictures)
    return {
        "model": str(folder),
        "steps": result.step,
        "seconds": seconds,
        "before": before,
        "after": after,
        "checkpoint": str(result.checkpoint),
    }


def describe(result: dict[str, Any]) -> list[str]:
    """The demo's outcome as lines for the terminal."""
    lines = [f"  expected {s['expected']!r}, said {s['said']!r}" for s in result["after"]["samples"][:6]]
    before, after = result["before"], result["after"]
    lines.append(
        f"colour named right: before {before['right']}/{before['rows']} = {before['share']:.1%}, "
        f"after {result['steps']} steps ({result['seconds']:.0f} s) {after['right']}/{after['rows']} = "
        f"{after['share']:.1%}; checkpoint: {result['checkpoint']}"
    )
    return lines
