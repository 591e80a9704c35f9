"""``roundhouse chat CHECKPOINT``: a conversation with a checkpoint (or a model) in the terminal.

Each line read from stdin is a user turn; the answer streams to stdout as it is sampled, through
the same chat template and sampler as the API's playground (``engine.inference.chat``), and the conversation
is kept: each answer sees the turns before it. ``/reset`` starts over, ``/exit`` or end of input
ends. Status lines (the finish reason and token count of each answer) go to stderr, so a piped
stdout holds only the answers, one per turn. Ctrl-C stops the answer being written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


def add_chat_command(
    sub: Any, with_models: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
) -> None:
    """Register ``chat`` on the ``roundhouse`` subcommands."""
    c = with_models(sub.add_parser("chat", help="chat with a checkpoint or a model in the terminal"))
    c.add_argument("model", metavar="CHECKPOINT", help='a checkpoint folder, a model folder, or "demo"')
    c.add_argument(
        "--base", help="the base model folder of a LoRA checkpoint (default: the one its run recorded)"
    )
    c.add_argument("--temperature", type=float, default=0.7, help="0: always the most likely token")
    c.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens of this mass")
    c.add_argument("--max-tokens", type=int, default=256, help="the most new tokens of one answer")
    c.add_argument("--seed", type=int, default=None, help="the same seed gives the same answers")
    c.add_argument("--system", help="a system message that opens the conversation")
    c.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    from engine.inference.chat import Sampling
    from engine.inference.generate import load_for_inference
    from engine.model.loading import resolve_model_path

    sampling = Sampling(args.temperature, args.top_p, args.max_tokens, args.seed)
    sampling.check()
    path = resolve_model_path(args.model, args.models_dir) if args.model == "demo" else Path(args.model)
    if args.base:
        model, tokenizer = load_for_inference(Path(args.base), adapter=path)
    else:
        model, tokenizer = load_for_inference(path)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    return converse(
        model, tokenizer, sampling, opening=opening, stdin=sys.stdin, out=sys.stdout, err=sys.stderr
    )


def converse(
    model: Any,
    tokenizer: Any,
    sampling: Any,
    *,
    opening: list[dict[str, str]],
    stdin: TextIO,
    out: TextIO,
    err: TextIO,
) -> int:
    """The read-answer loop until end of input or ``/exit``."""
    from engine.inference.chat import Finish, Piece, chat_stream

    interactive = stdin.isatty()
    if interactive:
        err.write("Type a message. /reset starts over; /exit or Ctrl-D ends; Ctrl-C stops an answer.\n")
    messages = list(opening)
    while True:
        if interactive:
            err.write("you> ")
            err.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            err.write("\n")
            return 0
        if not line:
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = list(opening)
            err.write("[a new conversation]\n")
            continue
        messages.append({"role": "user", "content": text})
        parts: list[str] = []
        finish: Finish | None = None
        try:
            for event in chat_stream(model, tokenizer, messages, sampling=sampling):
                if isinstance(event, Piece):
                    parts.append(event.text)
                    out.write(event.text)
                    out.flush()
                else:
                    finish = event
        except KeyboardInterrupt:
            pass
        except ValueError as exc:  # a conversation longer than the model's context
            messages.pop()
            err.write(f"[{exc}]\n")
            continue
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": "".join(parts)})
        if finish is None:
            err.write("[stopped]\n")
        else:
            err.write(f"[{finish.reason}: {finish.completion_tokens} tokens]\n")
        err.flush()
