"""llama.cpp runs our GGUF exports: per dense family, a tiny model exported (f16 and q8_0),
loaded by llama.cpp through ``llama-cpp-python``, its greedy tokens and last-position logits
compared with transformers on the same model (for q8_0: its matrices rounded through Q8_0,
as the file holds them).

    python bench/gguf_llamacpp.py [--families llama,qwen3] [--install] [--tokens 12]

``llama-cpp-python`` builds llama.cpp from source (cmake and a C++ compiler; tens of minutes on
two cores), so it is not in requirements.txt: ``--install`` runs ``pip install
llama-cpp-python==0.3.36`` into this interpreter first. Without it importable the script says so
and writes that into the results. Writes bench/results/gguf_llamacpp.json.

The tiny models use a byte-level BPE tokenizer trained here with merges (llama.cpp refuses a
vocabulary without merges) and a larger initialisation, so that the greedy choices are not near
ties that float rounding could flip. The prompt is given to both as token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "gguf_llamacpp.json"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "glm4", "olmo2", "phi3", "granite", "gemma3")
# sliding windows llama.cpp does not run for these architectures (the export caps the context)
NO_WINDOW: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},
    "qwen2": {"use_sliding_window": False},
    "smollm3": {"use_sliding_window": False},
    "phi3": {"sliding_window": None},
}
CORPUS = [
    "the quick brown fox jumps over the lazy dog and the dog sleeps in the sun",
    "what is two plus three? five. what is one plus one? two. what is four plus four? eight.",
    "a system prompt, a user question and an assistant answer make one conversation",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and symbols + - = ?",
]


def install() -> str:
    """Build and install llama-cpp-python from source; returns what happened."""
    started = time.time()
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-binary", "llama-cpp-python", LLAMA_CPP_PYTHON],
        env=env,
        capture_output=True,
        text=True,
    )
    took = time.time() - started
    if done.returncode != 0:
        return f"pip install {LLAMA_CPP_PYTHON} failed after {took:.0f} s: {done.stderr.strip()[-600:]}"
    return f"built and installed {LLAMA_CPP_PYTHON} in {took:.0f} s"


def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    # in no llama.cpp pre-tokenizer table: named for the GGUF export (GPT-2's byte-level split)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token=None,
        gguf_pre_tokenizer="gpt-2",
    )


def model(family: str, vocab: int) -> Any:
    import torch

    from tests.engine.tiny import tiny_model

    m = tiny_model(family, blocks=2, vocab_size=vocab, initializer_range=0.2, **NO_WINDOW.get(family, {}))
    m.eval()
    torch.manual_seed(0)
    with torch.no_grad():  # norms away from their initial value, so a wrong offset shows
        for p in m.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def q8_rounded(m: Any) -> Any:
    """A copy of ``m`` whose matrices went through Q8_0 and back, as the q8_0 file holds them
    (norms and vectors stay float32; a row length not a multiple of 32 stays f16 in the file)."""
    import copy

    import gguf
    import numpy as np
    import torch

    out = copy.deepcopy(m)
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.ndim < 2 or "norm" in name:
                continue
            a = p.numpy()
            back = gguf.quants.dequantize(gguf.quants.quantize(a, q8), q8) if a.shape[-1] % 32 == 0 else a
            p.copy_(torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)))
    return out


def greedy_transformers(m: Any, prompt: list[int], n: int) -> tuple[list[int], Any]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        first = m(ids).logits[0, -1]
        out = m.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt) :].tolist(), first


def greedy_llamacpp(path: Path, prompt: list[int], n: int) -> tuple[list[int], Any]:
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval(prompt)
    first = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    tokens = []
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        llm.eval([token])
    return tokens, first


def one(family: str, work: Path, *, n: int) -> dict[str, Any]:
    import numpy as np

    from engine.export.gguf_model import export_gguf

    tok = tokenizer()
    m = model(family, len(tok))
    # not the family's name: llama.cpp sets Phi-3's special-token attributes by general.name
    # ("phi3"), looking up tokens a real Phi-3 vocabulary has and this one lacks
    folder = work / f"tiny-{FAMILIES.index(family)}"
    m.save_pretrained(folder)
    tok.save_pretrained(folder)
    prompt = tok("what is two plus three? five. what is one plus")["input_ids"]
    references = {
        "f16": greedy_transformers(m, prompt, n),
        "q8_0": greedy_transformers(q8_rounded(m), prompt, n),
    }
    row: dict[str, Any] = {"family": family, "arch": type(m).__name__, "prompt_tokens": len(prompt)}
    for quant in ("f16", "q8_0"):
        want, want_first = references[quant]
        path = folder / f"model-{quant}.gguf"
        try:
            export_gguf(folder, path, quant=quant)
            got, got_first = greedy_llamacpp(path, prompt, n)
        except Exception as exc:  # a failure is a result here
            row[quant] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            continue
        ref = want_first.numpy()
        row[quant] = {
            "same_greedy_tokens": got == want,
            "tokens_equal": sum(a == b for a, b in zip(got, want, strict=True)),
            "tokens": n,
            "first_logits_rel_max_diff": float(np.abs(got_first - ref).max() / np.abs(ref).max()),
        }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--install", action="store_true", help=f"pip install {LLAMA_CPP_PYTHON} first")
    parser.add_argument("--tokens", type=int, default=12)
    args = parser.parse_args()
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "llama_cpp_python": None,
        "install": None,
        "families": [],
    }
    if args.install:
        result["install"] = install()
        print(result["install"])
    try:
        import llama_cpp

        result["llama_cpp_python"] = llama_cpp.__version__
    except ImportError as exc:
        result["error"] = (
            f"llama-cpp-python is not importable ({exc}); run with --install (builds llama.cpp from "
            "source: cmake and a C++ compiler)"
        )
        print(result["error"])
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        return 1
    with tempfile.TemporaryDirectory() as work:
        for family in args.families.split(","):
            row = one(family, Path(work), n=args.tokens)
            result["families"].append(row)
            print(json.dumps(row))
            RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
