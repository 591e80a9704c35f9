"""``roundhouse chat``: two prompts piped into it get two answers, each through the chat template
with the conversation so far, exactly what the sampler gives in process."""

from __future__ import annotations

import subprocess
from pathlib import Path

from engine.inference.chat import Piece, Sampling, chat_stream
from engine.inference.generate import load_for_inference
from tests.engine.tiny import tiny_model_folder
from tests.utils import ROOT, child_env, roundhouse


def greedy(folder: Path, messages: list[dict[str, str]], max_tokens: int) -> str:
    model, tokenizer = load_for_inference(folder)
    events = chat_stream(model, tokenizer, messages, sampling=Sampling(0.0, 1.0, max_tokens))
    return "".join(e.text for e in events if isinstance(e, Piece))


def test_chat_answers_each_piped_prompt_and_keeps_the_conversation(tmp_path: Path) -> None:
    folder = tiny_model_folder(tmp_path / "tiny")
    command = roundhouse("chat", str(folder), "--temperature", "0", "--max-tokens", "5")
    done = subprocess.run(
        command,
        input="hi\n\nok\n",  # a blank line is no turn
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    first = greedy(folder, [{"role": "user", "content": "hi"}], 5)
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "ok"},
    ]
    second = greedy(folder, chat, 5)
    assert done.stdout == f"{first}\n{second}\n"
    status = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(status) == 2 and all(line.endswith(" tokens]") for line in status), done.stderr


def test_chat_refuses_bad_sampling_values(tmp_path: Path) -> None:
    from engine.commands.cli import main

    folder = tiny_model_folder(tmp_path / "tiny")
    assert main(["chat", str(folder), "--top-p", "0"]) == 2
