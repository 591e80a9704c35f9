"""Supervised fine-tuning (``method.objective: "sft"``): next-token cross entropy on the answers.

Its options are the common ones (what trains, the LoRA settings); its rows are chat,
instruction, prompt/completion or text, packed when ``data.packing`` is set. The torch side is
``engine.methods.sft.train``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.methods.contract import Chart, Method, MethodOptions


class SftOptions(MethodOptions):
    """Supervised fine-tuning: a LoRA adapter or every weight, on the answers' tokens."""

    objective: Literal["sft"] = Field("sft", description="supervised fine-tuning")


METHOD = Method(
    name="sft",
    title="Supervised fine-tuning",
    description=(
        "next-token cross entropy on the answers of chat (with images, for a vision-language model), "
        "ShareGPT/LLaVA, instruction, prompt/completion or text rows"
    ),
    options=SftOptions,
    data_format="supervised",
    needs="chat, ShareGPT/LLaVA, instruction, prompt/completion or text rows",
    metric_keys=("accuracy/train", "accuracy/val"),
    charts=(
        Chart(
            id="token-accuracy-chart",
            title="Token accuracy",
            hint=(
                "The share of the answers' tokens the model predicts right (its most likely next token), "
                "in training and on the validation rows."
            ),
            ylabel="accuracy",
            lines=(("train", "accuracy/train"), ("validation", "accuracy/val")),
            share=True,
        ),
    ),
    order=0,
)
