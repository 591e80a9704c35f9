"""`make gpu-bundle` and the preflight: a bare box with only torch, the GPU image's packages and
the bundle runs the side-by-side bench's CPU dry run to the end; and the preflight names what is
missing or changed."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# pip's words when it cannot reach the package index (a machine without network)
OFFLINE = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution")


def load(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (``bench/`` is no package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bundle = load("bundle")
preflight = load("preflight")


def test_the_preflight_names_a_missing_package_with_the_version_wanted() -> None:
    pins = bundle.engine_pins()
    wanted = {pin.key: pin.version for pin in pins}
    found = dict.fromkeys(map(bundle.canonical, bundle.IMAGE), "1.0") | wanted
    found |= {"pydantic": None, "transformers": "5.17.0", "anyio": "4.0.0", "psutil": None}

    problems = preflight.package_problems(pins, bundle.IMAGE, lambda name: found.get(bundle.canonical(name)))

    assert f"missing: pydantic=={wanted['pydantic']}" in problems
    assert any(
        p.startswith(f"transformers 5.17.0 found where {wanted['transformers']} is wanted") for p in problems
    )
    assert "missing: psutil (the GPU image's own, not in the bundle)" in problems
    # anyio is not one of the project's pins: another version passes here, if the others accept it
    assert len(problems) == 3, problems


def test_the_preflight_names_a_renamed_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    masks = types.ModuleType("old_masking_utils")

    def create_causal_mask(
        config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None
    ):  # type: ignore[no-untyped-def]
        """transformers < 5.3's parameter names."""

    masks.create_causal_mask = create_causal_mask  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "old_masking_utils", masks)
    api = dataclasses.replace(preflight.ENGINE_APIS[0], module="old_masking_utils")

    problems = preflight.api_problems(api)

    assert any("no parameter 'inputs_embeds'" in p for p in problems), problems
    assert any("no parameter 'cache'" in p for p in problems), problems
    assert any("missing a required argument: 'input_embeds'" in p for p in problems), problems
    assert all("engine/model/block_context.py" in p for p in problems), problems


def test_the_installed_transformers_takes_the_engines_arguments_and_not_the_peers() -> None:
    for api in preflight.ENGINE_APIS:
        assert preflight.api_problems(api) == [], api
    # roundpipe 0.1.1 passes input_embeds, which transformers >= 5.3 renamed: the check must see it
    problems = preflight.api_problems(preflight.PEER_APIS[0])
    assert any("no parameter 'input_embeds'" in p for p in problems), problems


def test_the_engine_passes_the_names_the_preflight_checks() -> None:
    for api in preflight.ENGINE_APIS:
        source = (ROOT / api.caller).read_text()
        assert api.qualname.split(".")[0] in source or api.positional, api
        named = (ROOT / (api.keywords_at or api.caller)).read_text()
        for keyword in api.keywords:
            assert f'"{keyword}"' in named, (api.keywords_at or api.caller, keyword)


def image_distributions(*, leave_out: set[str]) -> list[importlib.metadata.Distribution]:
    """The GPU image's packages (``bundle.IMAGE``) and what they need, as installed here.

    What a bundle carries is left out: on the box it comes from the bundle, not the image.
    """
    todo, seen, found = list(bundle.IMAGE), set(), []
    while todo:
        name = bundle.canonical(todo.pop())
        if name in seen or name in leave_out:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        found.append(dist)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def link_into(site: Path, dists: list[importlib.metadata.Distribution]) -> None:
    """Symbolic links in ``site`` to each distribution's top-level packages, modules and metadata."""
    for dist in dists:
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            if not top.endswith(".pth") and not (site / top).exists():
                (site / top).symlink_to(Path(str(dist.locate_file(top))))


def run(
    command: list[str], *, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_a_bare_box_with_torch_and_the_bundle_runs_the_bench(tmp_path: Path) -> None:
    side_by_side = BENCH / "side_by_side.py"
    out = tmp_path / "gpu-bundle"
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    started = time.perf_counter()
    built = run([sys.executable, BENCH / "bundle.py", "--python-version", here, "--out", out])
    if built.returncode != 0 and any(word in built.stderr for word in OFFLINE):
        pytest.skip(f"no package index reachable: {built.stderr[-500:]}")
    assert built.returncode == 0, built.stdout + built.stderr
    print(built.stdout, f"built in {time.perf_counter() - started:.1f} s", sep="")

    # the box: a fresh virtualenv holding torch and the image's packages (links to this venv's)
    box = tmp_path / "box"
    made = run([sys.executable, "-m", "venv", "--without-pip", box])
    assert made.returncode == 0, made.stderr
    python = box / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    carried = {pin.key for pins in bundle.bundles().values() for pin in pins}
    image = image_distributions(leave_out=carried)
    link_into(site, image)
    print("image:", " ".join(sorted(d.metadata["Name"] for d in image)))

    targets = {}
    for name in ("engine", "peer"):
        targets[name] = tmp_path / f"rh-{name}"
        started = time.perf_counter()
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        done = run([*install, "--target", targets[name], *sorted((out / name).glob("*.whl"))])
        assert done.returncode == 0, done.stderr
        print(f"{name}: installed in {time.perf_counter() - started:.1f} s")

    bare = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    bare["HF_HUB_OFFLINE"] = "1"
    engine_env = bare | {"PYTHONPATH": str(targets["engine"])}
    peer_env = bare | {
        "PYTHONPATH": str(targets["peer"]),
        "PATH": os.pathsep.join([str(targets["peer"] / "bin"), bare["PATH"]]),
        "RPP_DISABLE_TORCH_COMPILE": "1",
    }

    # the controls: without the bundle the box has no pydantic, and the preflight says so
    assert run([python, "-c", "import pydantic"], env=bare).returncode != 0
    failed = run([python, BENCH / "preflight.py", "--cpu"], env=bare)
    assert failed.returncode == 1 and "missing: pydantic==" in failed.stdout, failed.stdout + failed.stderr
    # the engine's bundle on the peer's transformers: the renamed parameters are named
    crossed = run([python, BENCH / "preflight.py", "--cpu", "--peer"], env=engine_env)
    assert crossed.returncode == 1 and "no parameter 'input_embeds'" in crossed.stdout, crossed.stdout

    for env, flags in ((engine_env, []), (peer_env, ["--peer"])):
        checked = run([python, BENCH / "preflight.py", "--cpu", *flags], env=env)
        print(checked.stdout)
        assert checked.returncode == 0, checked.stdout + checked.stderr

    report = tmp_path / "side_by_side.json"
    started = time.perf_counter()
    ran = run([python, side_by_side, "--cpu", "--out", report], env=engine_env)
    print(f"side_by_side.py --cpu: {time.perf_counter() - started:.1f} s\n{ran.stdout[-3000:]}")
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    rows = json.loads(report.read_text())["systems"]
    engine_rows = {name: row for name, row in rows.items() if name.startswith("engine")}
    assert engine_rows, rows
    for name, row in engine_rows.items():
        assert row.get("tokens_per_s_steady", 0) > 0, (name, row)
