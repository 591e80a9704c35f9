"""Preflight for a GPU box: is everything the bench needs there, at the versions it expects?

Run it on the box before anything else, with the ``PYTHONPATH`` the bench will have. It names,
all at once:

- every package of the bundle (``bench/bundle.py``) that is missing or at another version than
  the project pins, and every package the GPU image must provide (torch, numpy, ...) that is
  missing or too old for the bundle's packages (their ``Requires-Dist``);
- every changed API the engine calls into with keyword arguments, e.g. the parameters it passes
  ``transformers.masking_utils.create_causal_mask``: a parameter gone, or a new required one;
- the engine's own modules that fail to import;
- torch below the floor, and no CUDA device (unless ``--cpu``).

``--peer`` checks the peer's folder instead (roundpipe 0.1.1, which cannot be imported without a
GPU: its files and versions, its transformers' ``create_causal_mask`` taking ``input_embeds``,
and ninja and a C++ compiler for its JIT-built Adam). The exit code is 1 when anything is wrong.

    PYTHONPATH=DIR python3 bench/preflight.py [--peer] [--cpu]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import platform
import shutil
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # bundle.py, the one list of pins

from bundle import IMAGE, PEER, TORCH_FLOOR, UNUSED, Pin, canonical, engine_pins  # noqa: E402

ENGINE_PYTHON = (3, 11)  # transformers 5.24 and accelerate 1.16 require it


@dataclass(frozen=True)
class Api:
    """A call into a library whose signature the caller depends on.

    ``positional``: how many arguments the caller passes by position (``self`` included);
    ``keywords``: the names it passes; ``caller``: where (a test checks the engine's names there);
    ``keywords_at``: where the caller's keyword names are written when not in ``caller`` itself
    (the arguments built in one module, passed as ``**`` in another).
    """

    module: str
    qualname: str
    positional: int
    keywords: tuple[str, ...]
    caller: str
    keywords_at: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


MASK_KEYWORDS = ("config", "inputs_embeds", "attention_mask", "cache", "position_ids")
LLAMA = "transformers.models.llama.modeling_llama"
ENGINE_APIS = (
    Api(
        "transformers.masking_utils",
        "create_causal_mask",
        0,
        MASK_KEYWORDS,
        "engine/model/block_context.py",
        "engine/model/adapter.py",
    ),
    Api(
        "transformers.masking_utils",
        "create_sliding_window_causal_mask",
        0,
        MASK_KEYWORDS,
        "engine/model/block_context.py",
        "engine/model/adapter.py",
    ),
    Api(
        LLAMA,
        "LlamaDecoderLayer.forward",
        2,
        ("attention_mask", "position_embeddings", "position_ids", "cache", "use_cache"),
        "engine/model/block_context.py",
    ),
    Api(LLAMA, "LlamaRotaryEmbedding.forward", 3, (), "engine/model/adapter.py"),
)
# names the engine takes from its libraries ("module:attribute")
ENGINE_NAMES = (
    "transformers:LlamaConfig",
    "transformers:LlamaForCausalLM",
    "peft:LoraConfig",
    "peft:get_peft_model",
    "peft.tuners.tuners_utils:BaseTunerLayer",
)
ENGINE_MODULES = ("engine.config", "engine.roundpipe", "engine.model.adapter", "engine.training.run")
PEER_APIS = (
    Api(
        "transformers.masking_utils",
        "create_causal_mask",
        0,
        ("config", "input_embeds", "attention_mask", "cache_position", "past_key_values", "position_ids"),
        "roundpipe 0.1.1 (models/llama.py)",
    ),
)
PEER_FILES = ("roundpipe/__init__.py", "roundpipe/optim/csrc/adam.cpp")


def installed_version(name: str) -> str | None:
    """The version of the distribution ``name`` first found on ``sys.path``, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_problems(
    pins: Iterable[Pin], image: Iterable[str], version_of: Callable[[str], str | None] = installed_version
) -> list[str]:
    """Pins missing or at another version (exact pins only); image packages missing."""
    problems = []
    for pin in pins:
        found = version_of(pin.name)
        if found is None:
            problems.append(f"missing: {pin.name}=={pin.version}")
        elif pin.exact and found != pin.version:
            problems.append(
                f"{pin.name} {found} found where {pin.version} is wanted (bundle not first on PYTHONPATH?)"
            )
    for name in image:
        if version_of(name) is None:
            problems.append(f"missing: {name} (the GPU image's own, not in the bundle)")
    return problems


def requirement_problems(
    names: Iterable[str], version_of: Callable[[str], str | None] = installed_version
) -> list[str]:
    """What the installed distributions ``names`` require (``Requires-Dist``) and do not get."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return ["missing: packaging (the GPU image's own): the bundle's requirements cannot be checked"]
    problems: dict[str, str] = {}
    for name in names:
        version = version_of(name)
        if version is None:
            continue
        for line in importlib.metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            key = canonical(req.name)
            if key in UNUSED:
                continue
            found = version_of(req.name)
            if found is None:
                problems.setdefault(key, f"missing: {req.name}{req.specifier} (needed by {name} {version})")
            elif not req.specifier.contains(found, prereleases=True):
                problems[f"{key} {name}"] = (
                    f"{req.name} {found} found; {name} {version} needs {req.name}{req.specifier}"
                )
    return list(problems.values())


def present(module: str) -> bool:
    """Whether the top-level package of ``module`` can be found (without importing it)."""
    return importlib.util.find_spec(module.split(".")[0]) is not None


def resolve(dotted: str, qualname: str) -> object:
    target: object = importlib.import_module(dotted)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def api_problems(api: Api) -> list[str]:
    """A parameter ``api.caller`` passes that the callable lost, or one it now requires."""
    try:
        fn = resolve(api.module, api.qualname)
    except (ImportError, AttributeError) as e:
        return [f"{api.name} is gone ({type(e).__name__}: {e}); {api.caller} calls it"]
    signature = inspect.signature(fn)  # type: ignore[arg-type]
    named = {
        p.name
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    # a name taken only by **kwargs would be ignored silently: a rename shows up here
    lost = [k for k in api.keywords if k not in named]
    problems = [
        f"{api.name} has no parameter {k!r} ({api.caller} passes it); it takes {sorted(named)}" for k in lost
    ]
    try:
        signature.bind(*[None] * api.positional, **dict.fromkeys(k for k in api.keywords if k in named))
    except TypeError as e:
        problems.append(f"{api.name}: {e} (as {api.caller} calls it)")
    return problems


def name_problems(names: Iterable[str]) -> list[str]:
    problems = []
    for spec in names:
        module, attribute = spec.split(":")
        try:
            resolve(module, attribute)
        except (ImportError, AttributeError) as e:
            problems.append(f"{module}.{attribute} is gone ({type(e).__name__}: {e})")
    return problems


def import_problems(modules: Iterable[str]) -> list[str]:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    problems = []
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            problems.append(
                f"import {module} failed: {type(e).__name__}: {e} ({where.filename}:{where.lineno})"
            )
    return problems


def torch_problems(*, cuda: bool) -> tuple[list[str], str]:
    """torch below the floor or without CUDA; and a line saying what was found."""
    try:
        import torch
    except Exception as e:
        return [f"import torch failed: {type(e).__name__}: {e} (torch is the GPU image's own)"], "no torch"
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    problems = []
    if release < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        problems.append(f"torch {torch.__version__} is older than {floor}, the floor the engine is tested at")
    found = f"torch {torch.__version__} ({Path(torch.__file__).parent.parent})"
    if not cuda:
        return problems, found + ", CUDA not checked (--cpu)"
    if not torch.cuda.is_available():
        problems.append(
            f"CUDA is not available to torch {torch.__version__} (built for CUDA {torch.version.cuda})"
        )
        return problems, found
    return problems, found + f", CUDA {torch.version.cuda} on {torch.cuda.get_device_name(0)}"


def tool_problems() -> list[str]:
    """What the peer's JIT build of its C++ Adam runs: ninja and a C++ compiler (torch's ``CXX``)."""
    problems = []
    if shutil.which("ninja") is None:
        problems.append("no ninja on PATH (the peer folder's bin/: PATH=DIR/bin:$PATH)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        problems.append(f"no C++ compiler {compiler!r} on PATH (g++; or set CXX)")
    return problems


def file_problems(distribution: str, files: Iterable[str]) -> list[str]:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return []  # already named as missing
    return [f"{distribution}: {f} is missing" for f in files if not Path(str(dist.locate_file(f))).is_file()]


def check(*, peer: bool = False, cuda: bool = True) -> tuple[list[str], list[str]]:
    """Everything wrong for the engine's bench (or, with ``peer``, the peer's) in this interpreter.

    Returns:
        The problems (empty: ready) and a few lines of what was found.
    """
    pins = PEER if peer else engine_pins()
    problems: list[str] = []
    if not peer and sys.version_info < ENGINE_PYTHON:
        problems.append(
            f"Python {platform.python_version()} is older than {'.'.join(map(str, ENGINE_PYTHON))}"
        )
    torch_found, torch_line = torch_problems(cuda=cuda)
    problems += torch_found
    problems += package_problems(pins, IMAGE)
    problems += requirement_problems(pin.name for pin in pins)
    # a library that is not there at all is named above, not once per function taken from it
    apis = [api for api in (PEER_APIS if peer else ENGINE_APIS) if present(api.module)]
    problems += [p for api in apis for p in api_problems(api)]
    if peer:
        problems += file_problems("roundpipe", PEER_FILES)
        problems += tool_problems()
    else:
        problems += name_problems(spec for spec in ENGINE_NAMES if present(spec.split(":")[0]))
        problems += import_problems(ENGINE_MODULES)
    at = [f"{pin.name} {installed_version(pin.name) or 'missing'}" for pin in pins if pin.exact]
    found = [f"Python {platform.python_version()} ({sys.executable})", torch_line, ", ".join(at)]
    return problems, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", action="store_true", help="check the peer's folder (roundpipe 0.1.1)")
    parser.add_argument("--cpu", action="store_true", help="do not require a CUDA device")
    args = parser.parse_args()
    what = "peer" if args.peer else "engine"
    problems, found = check(peer=args.peer, cuda=not args.cpu)
    for line in found:
        print(f"preflight ({what}): {line}")
    if not problems:
        print(f"preflight ({what}): ok")
        return
    print(f"preflight ({what}): {len(problems)} problem(s):")
    for problem in problems:
        print(f"  - {problem}")
    sys.exit(1)


if __name__ == "__main__":
    main()
