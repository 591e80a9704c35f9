"""Wheels for a bare GPU box: what the bench needs there that the machine's own image lacks.

A GPU box of this kind has Python, torch and the common scientific packages (``IMAGE``) but no
pydantic and an older transformers, and it cannot reach a package index. This builds, here, two
folders of wheels to carry there, one version of each package, downloaded ``--no-deps`` for
CPython 3.12 on manylinux x86_64:

- ``gpu-bundle/engine/``: the engine's packages (``ENGINE``). The project's own pins
  (``requirements.txt``) are used where it pins a package; the rest are pinned below.
- ``gpu-bundle/peer/``: the paper authors' ``roundpipe`` 0.1.1 and what it needs beside torch
  (``PEER``): its own, older transformers, so it runs in its own process with its own
  ``PYTHONPATH``. Its C++ Adam is built on first use with ``g++`` and ``ninja``.

Each folder is installed on the box with ``pip install --no-index --no-deps --target DIR``; torch
stays the image's. ``bench/preflight.py`` then names anything still missing or changed.

    python bench/bundle.py [--python-version 3.12] [--out gpu-bundle] [--only engine|peer]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements.txt"
DEFAULT_OUT = ROOT / "gpu-bundle"
# pip matches a manylinux tag exactly, so every glibc level a wheel may be built for is named
# (up to the GPU image's Ubuntu 24.04, glibc 2.39)
PLATFORMS = (
    "manylinux1_x86_64",
    "manylinux2010_x86_64",
    "manylinux2014_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35, 39)),
)
# the minimum torch of the engine on a GPU box (the image's, which stays): no API newer is used
TORCH_FLOOR = (2, 11)


@dataclass(frozen=True)
class Pin:
    """One package of a bundle.

    ``exact``: the preflight wants this very version. Otherwise it wants the package present and
    at a version every other package of the bundle accepts (what their ``Requires-Dist`` say).
    """

    name: str
    version: str
    exact: bool

    @property
    def key(self) -> str:
        return canonical(self.name)


# the engine's packages the project pins in requirements.txt (their versions are read there)
ENGINE_PINNED = ("pydantic", "transformers", "huggingface_hub", "tokenizers", "peft", "accelerate")
# what those need that the image lacks or has too old (huggingface_hub 2 wants click >= 8.4.2)
ENGINE_DEPENDENCIES = {
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",
    "click": "8.5.1",
    "httpx2": "2.16.2",
    "httpcore2": "2.16.2",
    "truststore": "0.10.5",
    "idna": "3.20",
    "anyio": "4.16.0",
    "h11": "0.16.0",
    "hf-xet": "1.8.0",
}
# roundpipe 0.1.1 calls create_causal_mask(input_embeds=...), which transformers renamed in 5.3:
# it runs on transformers 5.0.0, whose huggingface_hub must stay below 2 (httpx, not httpx2)
PEER = (
    Pin("roundpipe", "0.1.1", exact=True),
    Pin("beartype", "0.23.1", exact=True),
    Pin("transformers", "5.0.0", exact=True),
    Pin("tokenizers", "0.22.2", exact=True),
    Pin("huggingface_hub", "1.33.0", exact=False),
    Pin("py-cpuinfo", "9.0.0", exact=False),
    Pin("ninja", "1.13.2", exact=False),
    Pin("httpx", "0.28.1", exact=False),
    Pin("httpcore", "1.0.9", exact=False),
    Pin("certifi", "2026.10.19.post1", exact=False),
    Pin("anyio", "4.16.0", exact=False),
    Pin("idna", "3.20", exact=False),
    Pin("h11", "0.16.0", exact=False),
    Pin("click", "8.5.1", exact=False),
    Pin("hf-xet", "1.8.0", exact=False),
    Pin("typing-extensions", "4.16.0", exact=False),
)
# what both bundles leave to the GPU box's image (torch with its own dependencies comes too);
# the preflight checks that each is there at a version the bundle's packages accept
IMAGE = ("torch", "numpy", "safetensors", "packaging", "pyyaml", "regex", "tqdm", "psutil")
# required by transformers for its command-line tool alone, never imported by the bench: neither
# carried nor checked
UNUSED = ("typer", "typer-slim")


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): ``Typing_Ext`` -> ``typing-ext``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_pins(path: Path = REQUIREMENTS) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line of a requirements file (canonical names)."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if "==" in spec:
            name, version = spec.split("==", 1)
            pins[canonical(name.split("[", 1)[0])] = version.strip()
    return pins


def engine_pins(requirements: Path = REQUIREMENTS) -> tuple[Pin, ...]:
    """The engine bundle: the project's pins from ``requirements``, then their dependencies."""
    pinned = project_pins(requirements)
    missing = [name for name in ENGINE_PINNED if canonical(name) not in pinned]
    if missing:
        raise ValueError(f"{requirements} pins no version of {', '.join(missing)}")
    own = tuple(Pin(name, pinned[canonical(name)], exact=True) for name in ENGINE_PINNED)
    return own + tuple(Pin(name, version, exact=False) for name, version in ENGINE_DEPENDENCIES.items())


def bundles() -> dict[str, tuple[Pin, ...]]:
    """Each bundle's folder name and its packages."""
    return {"engine": engine_pins(), "peer": PEER}


def wheel_key(path: Path) -> str:
    """The canonical distribution name of a wheel file (``pydantic_core-2.50.5-cp312-...whl``)."""
    return canonical(path.name.split("-", 1)[0])


def download(pins: tuple[Pin, ...], folder: Path, *, python_version: str) -> None:
    """Fill ``folder`` with exactly one wheel of each pin for ``python_version`` on manylinux x86_64.

    Wheels already there at the pinned version for the same Python are kept; any other wheel is
    removed (two versions of one package stop the whole install on the box).

    Raises:
        RuntimeError: pip could not download a pin, or a pin has no single wheel afterwards.
    """
    folder.mkdir(parents=True, exist_ok=True)
    built_for = folder / ".python-version"  # compiled wheels are for one Python
    same_python = built_for.exists() and built_for.read_text().strip() == python_version
    wanted = {pin.key: pin for pin in pins}
    for wheel in folder.glob("*.whl"):
        pin = wanted.get(wheel_key(wheel))
        if not same_python or pin is None or wheel.name.split("-")[1] != pin.version:
            wheel.unlink()
    built_for.write_text(python_version + "\n")
    have = {wheel_key(wheel) for wheel in folder.glob("*.whl")}
    fetch = [f"{pin.name}=={pin.version}" for pin in pins if pin.key not in have]
    if fetch:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
        command += ["--python-version", python_version, "--implementation", "cp", "--dest", str(folder)]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        done = subprocess.run(command + fetch, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip download failed for {' '.join(fetch)}:\n{done.stderr[-3000:]}")
    found: dict[str, list[str]] = {}
    for wheel in folder.glob("*.whl"):
        found.setdefault(wheel_key(wheel), []).append(wheel.name)
    wrong = {pin.name: found.get(pin.key, []) for pin in pins if len(found.get(pin.key, [])) != 1}
    if wrong:
        raise RuntimeError(f"{folder}: not one wheel each: {wrong}")


def folder_bytes(folder: Path) -> int:
    return sum(wheel.stat().st_size for wheel in folder.glob("*.whl"))


def box_commands(out: Path, names: list[str]) -> list[str]:
    """What to run on the box, from the checkout's root, with ``out`` carried along."""
    rel = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    install = "python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target"
    lines = [f"{install} /tmp/rh-{name} {rel}/{name}/*.whl" for name in names]
    if "engine" in names:
        lines.append("PYTHONPATH=/tmp/rh-engine python3 bench/preflight.py")
    if "peer" in names:
        lines.append("PYTHONPATH=/tmp/rh-peer PATH=/tmp/rh-peer/bin:$PATH python3 bench/preflight.py --peer")
    if "engine" in names:
        # the peer's ninja is found on PATH by its C++ Adam's build; side_by_side.py gives the
        # peer's process PYTHONPATH=<--peer>, the engine's keep this one
        peer = " --peer /tmp/rh-peer" if "peer" in names else ""
        path = "PATH=/tmp/rh-peer/bin:$PATH " if "peer" in names else ""
        lines.append(f"{path}PYTHONPATH=/tmp/rh-engine python3 bench/side_by_side.py{peer}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU box's Python (default 3.12)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the bundle folder")
    parser.add_argument("--only", choices=("engine", "peer"), default=None, help="build one folder")
    args = parser.parse_args()
    out = args.out.resolve()
    chosen = {name: pins for name, pins in bundles().items() if args.only in (None, name)}
    for name, pins in chosen.items():
        folder = out / name
        download(pins, folder, python_version=args.python_version)
        size = folder_bytes(folder) / 1e6
        print(f"{folder}: {len(pins)} wheels, {size:.1f} MB (CPython {args.python_version})")
    total = sum(folder_bytes(out / name) for name in chosen)
    print(f"total {total / 1e6:.1f} MB; on the GPU box, from the checkout's root, {out.name}/ carried:")
    print(" && ".join(box_commands(out, list(chosen))))


if __name__ == "__main__":
    main()
