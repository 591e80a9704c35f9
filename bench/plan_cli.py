"""How long ``roundhouse plan`` takes on the command line, net of starting Python, against
``POST /api/plan`` answering the same plan: the paper's five models (``plan_speed.PAPER``, from
their config shapes in a model folder each) on 8 GPUs of 24 GB at 2048 tokens a sequence, batch
16 in 16 micro-batches, 1000 steps, as a full fine-tune (512 GB of host RAM) and as LoRA (128 GB).

Each command is a fresh process, ``server.cli.main`` (what the ``roundhouse`` script runs), and
each is timed right after a bare ``python -c pass`` (alternating, same environment): its net time
is the command's wall time minus the bare start's, medians over ``--repeats``. CPU time (user +
system, ``os.wait4``) is recorded too: on a shared, loaded machine the wall time also counts the
wait for a core. Two bytecode modes: ``pyc``, the modules' bytecode cached (in a temporary
``PYTHONPYCACHEPREFIX``, warmed by one untimed run), as an installed package has it; ``source``,
this environment as it is (``PYTHONDONTWRITEBYTECODE=1`` here: the project's modules are compiled
on every start). The target is a net wall median <= 300 ms in ``pyc`` mode.

The API's figure is the request's wall time in the client (the service in this process, as in
``plan_speed.py``): ``cold`` with the planner's caches cleared before each request, ``warm``
the same request again. Each model's CLI output must contain the API's plan
(``PlanReport.describe()`` of its answer): ``same_plan``.

``--before REV`` also times the ``roundhouse plan`` of git revision REV (a temporary worktree,
fewer repeats: it took seconds).

    python bench/plan_cli.py [--repeats 7] [--modes pyc source] [--before f2312e3] [--before-repeats 2]

Results: ``bench/results/plan_cli.json``.
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
from importlib import metadata
from pathlib import Path
from typing import Any

import plan_speed

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TARGET_MS = 300.0
BOX = ["--workers", "8", "--gpu-memory-gb", "24", "--microbatches", "16", "--batch-size", "16"]
BOX += ["--seq-len", "2048", "--steps", "1000"]
SETTINGS: dict[str, dict[str, Any]] = {  # the CLI's flags and plan_speed's setting of the same plan
    "full-512GB": {
        "flags": ["--method", "full", "--host-ram-gb", "512"],
        "api": plan_speed.SETTINGS["full-512GB"],
    },
    "lora-128GB": {
        "flags": ["--method", "lora", "--host-ram-gb", "128"],
        "api": plan_speed.SETTINGS["lora-128GB"],
    },
}
# runs server.cli's main from the tree given first, never an editable install's mapping of another
LAUNCH = """import sys
tree = sys.argv.pop(1)
sys.meta_path[:] = [
    f for f in sys.meta_path
    if not (f if isinstance(f, type) else type(f)).__module__.startswith("__editable__")
]
sys.path.insert(0, tree)
from server.cli import main
import engine
if not engine.__file__.startswith(tree):
    raise SystemExit(f"plan_cli: {tree} imported the engine of {engine.__file__}")
raise SystemExit(main())
"""


def child_env(mode: str, pycache: Path) -> dict[str, str]:
    env = dict(os.environ)
    if mode == "pyc":
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of one child process, and its output."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(
            f"{' '.join(command[3:])}: exit {os.waitstatus_to_exitcode(status)}\n{text[-2000:]}"
        )
    return wall, usage.ru_utime + usage.ru_stime, text


def model_folders(root: Path) -> dict[str, Path]:
    folders = {}
    for name in plan_speed.PAPER:
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(plan_speed.MODELS[name]))
        folders[name] = folder
    return folders


def plan_command(tree: Path, folder: Path, setting: str) -> list[str]:
    flags = ["plan", "--model", str(folder), *BOX, *SETTINGS[setting]["flags"]]
    return [sys.executable, "-c", LAUNCH, str(tree), *flags]


def ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 1)


def measure_cli(
    tree: Path, folders: dict[str, Path], *, repeats: int, mode: str, scratch: Path
) -> tuple[dict[str, Any], dict[tuple[str, str], str]]:
    """Every model and setting: ``repeats`` times a bare start, then the command."""
    env = child_env(mode, scratch / "pycache")
    bare_command = [sys.executable, "-c", "pass"]
    first = next(iter(folders.values()))
    timed(plan_command(tree, first, next(iter(SETTINGS))), env)  # compiles (pyc) and warms the disk
    out: dict[str, Any] = {}
    texts: dict[tuple[str, str], str] = {}
    for name, folder in folders.items():
        out[name] = {}
        for setting in SETTINGS:
            bare: list[tuple[float, float]] = []
            cli: list[tuple[float, float]] = []
            for _ in range(repeats):
                bare.append(timed(bare_command, env)[:2])
                wall, cpu, text = timed(plan_command(tree, folder, setting), env)
                cli.append((wall, cpu))
            texts[name, setting] = text
            walls, cpus = [w for w, _ in cli], [c for _, c in cli]
            bare_walls, bare_cpus = [w for w, _ in bare], [c for _, c in bare]
            row = {
                "net_wall_ms": round(ms(walls) - ms(bare_walls), 1),
                "net_cpu_ms": round(ms(cpus) - ms(bare_cpus), 1),
                "wall_ms": ms(walls),
                "cpu_ms": ms(cpus),
                "bare_wall_ms": ms(bare_walls),
                "bare_cpu_ms": ms(bare_cpus),
                "net_wall_min_ms": round(1000 * (min(walls) - min(bare_walls)), 1),
                "wall_runs_ms": [round(1000 * w, 1) for w in walls],
            }
            out[name][setting] = row
            print(
                f"{tree.name:10s} {mode:6s} {name:16s} {setting:11s} net {row['net_wall_ms']:8.1f} ms wall"
                f" {row['net_cpu_ms']:7.1f} ms cpu"
                f"  (command {row['wall_ms']:.0f}, bare {row['bare_wall_ms']:.0f})",
                flush=True,
            )
    return out, texts


def measure_floor(*, repeats: int, mode: str, scratch: Path) -> dict[str, float]:
    """What importing the planner alone takes, net of a bare start: the part of the command that
    any process that plans pays once (the service at its start)."""
    env = child_env(mode, scratch / "pycache")
    bare_command = [sys.executable, "-c", "pass"]
    command = [sys.executable, "-c", "import engine.planner"]  # from ROOT (the working directory)
    bare: list[tuple[float, float]] = []
    imports: list[tuple[float, float]] = []
    for _ in range(repeats):
        bare.append(timed(bare_command, env)[:2])
        imports.append(timed(command, env)[:2])
    return {
        "net_wall_ms": round(ms([w for w, _ in imports]) - ms([w for w, _ in bare]), 1),
        "net_cpu_ms": round(ms([c for _, c in imports]) - ms([c for _, c in bare]), 1),
    }


def measure_api(repeats: int) -> dict[str, Any]:
    """``POST /api/plan`` of each model and setting, cold and warm, in this process."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(home=Path(tmp) / "home", hub_offline=True, queue="plan-cli")
        app = create_app(settings)
        with TestClient(app) as client:
            client.headers["Authorization"] = f"Bearer {app.state.first_key}"
            for name in plan_speed.PAPER:
                out[name] = {}
                for setting, spec in SETTINGS.items():
                    body = plan_speed.request_body(plan_speed.MODELS[name], spec["api"])
                    client.post("/api/plan", json=body)  # the first request's imports
                    times: dict[str, list[float]] = {"cold": [], "warm": []}
                    answer: dict[str, Any] = {}
                    for kind in ("cold", "warm"):
                        for _ in range(repeats):
                            if kind == "cold":
                                plan_speed.clear_caches()
                            gc.collect()
                            start = time.perf_counter()
                            r = client.post("/api/plan", json=body)
                            times[kind].append(time.perf_counter() - start)
                            if r.status_code != 200:
                                raise RuntimeError(f"{name} {setting}: {r.status_code} {r.text}")
                            answer = r.json()
                    out[name][setting] = {
                        "cold_ms": ms(times["cold"]),
                        "warm_ms": ms(times["warm"]),
                        "answer": answer,
                    }
    return out


def describe(answer: dict[str, Any]) -> str:
    from engine.planner import PlanReport

    return PlanReport(**{k: v for k, v in answer.items() if k != "calibrated_from"}).describe()


def worktree(rev: str, tmp: Path) -> Path:
    tree = tmp / rev
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True)
    return tree


def machine(loads: list[list[float]]) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "engine", "server"],
        capture_output=True,
        text=True,
    )
    versions: dict[str, str | None] = {}
    for package in ("fastapi", "pydantic", "pydantic-settings", "psutil", "torch", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu_count": os.cpu_count(),
        "load_average_start_end": loads,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "versions": versions,
        "commit": commit.stdout.strip(),
        "uncommitted_files_in_engine_and_server": len(dirty.stdout.splitlines()),
        "pythondontwritebytecode": os.environ.get("PYTHONDONTWRITEBYTECODE"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed commands per model and setting")
    parser.add_argument("--modes", nargs="+", default=["pyc", "source"], choices=["pyc", "source"])
    parser.add_argument("--api-repeats", type=int, default=9)
    parser.add_argument(
        "--before", help="also time this git revision's command (e.g. the commit before a change)"
    )
    parser.add_argument("--before-repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_cli.json")
    args = parser.parse_args()
    loads = [[round(x, 2) for x in os.getloadavg()]]
    result: dict[str, Any] = {
        "what": "roundhouse plan (server.cli.main in a fresh process) net of a bare python start, "
        "and POST /api/plan of the same plan (in-process service, client wall time)",
        "target_net_ms": TARGET_MS,
        "box_flags": BOX,
        "settings": {k: v["flags"] for k, v in SETTINGS.items()},
        "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        folders = model_folders(scratch / "models")
        texts: dict[tuple[str, str], str] = {}
        after: dict[str, Any] = {}
        for mode in args.modes:
            after[mode], got = measure_cli(ROOT, folders, repeats=args.repeats, mode=mode, scratch=scratch)
            texts = texts or got
        floor = measure_floor(repeats=args.repeats, mode=args.modes[0], scratch=scratch)
        print(f"import engine.planner alone ({args.modes[0]}): net {floor}", flush=True)
        api = measure_api(args.api_repeats)
        if args.before:
            tree = worktree(args.before, scratch)
            try:
                before, _ = measure_cli(
                    tree, folders, repeats=args.before_repeats, mode="pyc", scratch=scratch
                )
            finally:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True
                )
            result["before_revision"] = args.before
            result["before"] = {"pyc": before}
    loads.append([round(x, 2) for x in os.getloadavg()])
    result["machine"] = machine(loads)
    result["after"] = after
    result["import_engine_planner_alone"] = {"mode": args.modes[0]} | floor
    result["api"] = {
        n: {s: {k: v for k, v in r.items() if k != "answer"} for s, r in m.items()} for n, m in api.items()
    }
    result["same_plan"] = {
        n: {s: describe(api[n][s]["answer"]) in texts[n, s] for s in SETTINGS} for n in api
    }
    primary = after.get("pyc") or next(iter(after.values()))
    result["after_meets_target"] = all(
        r["net_wall_ms"] <= TARGET_MS for m in primary.values() for r in m.values()
    )
    summary = {
        n: {
            s: {
                "cli_net_wall_ms": primary[n][s]["net_wall_ms"],
                "cli_net_cpu_ms": primary[n][s]["net_cpu_ms"],
                "api_cold_ms": result["api"][n][s]["cold_ms"],
                "api_warm_ms": result["api"][n][s]["warm_ms"],
            }
            | ({"before_net_wall_ms": result["before"]["pyc"][n][s]["net_wall_ms"]} if args.before else {})
            for s in SETTINGS
        }
        for n in plan_speed.PAPER
    }
    result["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                "summary": summary,
                "same_plan": result["same_plan"],
                "meets_target": result["after_meets_target"],
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
