"""API fuzzing: schemathesis over every operation of the OpenAPI schema, longer than ``make test``.

The same runner as ``tests/server/test_fuzz.py`` (``tests/utils/fuzzing.py``): the app in process
with its first API key, a dataset and a cancelled job in its database, every operation with
schema-valid (positive) and schema-invalid (negative) requests, against generated ids and the
existing ones. Checks on every answer: no 5xx, and the status, content type, headers and body are
ones the schema documents; a schema-invalid request gets a 4xx. The test runs derandomized with a
few cases each; this runs more cases under several seeds, on SQLite and (where one answers on
127.0.0.1:5432) PostgreSQL, each seed on a fresh database.

Target: 0 server errors and 0 schema violations. Figures go to ``bench/results/fuzz.json``; the
exit status is 1 when anything failed.

    python bench/fuzz.py [--examples 150] [--seeds 1 2 3] [--databases sqlite postgresql]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("schemathesis", "hypothesis", "fastapi", "starlette", "pydantic", "sqlalchemy", "psycopg"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def run_one(database: str, *, examples: int, seed: int) -> dict[str, Any]:
    """One seed on a fresh database: every operation's outcome, and the totals."""
    from server.app import create_app
    from server.settings import Settings
    from tests.engine.tiny import tiny_model_folder
    from tests.server.conftest import postgres_database
    from tests.utils.fuzzing import fuzz

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        home = Path(tmp) / "home"
        tiny_model_folder(home / "models" / "tiny")
        if database == "sqlite":
            url = f"sqlite:///{Path(tmp) / 'roundhouse.db'}"
        else:
            url = stack.enter_context(postgres_database())
        settings = Settings(
            home=home, database_url=url, max_upload_bytes=200_000, queue=f"fuzz-{uuid.uuid4().hex}"
        )
        app = create_app(settings)
        start = time.perf_counter()
        outcomes = fuzz(app, app.state.first_key, examples=examples, seed_value=seed)
        seconds = time.perf_counter() - start
        app.state.engine.dispose()
    statuses: Counter[int] = Counter()
    for o in outcomes:
        statuses.update(o.statuses)
    return {
        "database": database,
        "seed": seed,
        "cases": sum(o.cases for o in outcomes),
        "seconds": round(seconds, 1),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors": sum(v for k, v in statuses.items() if k >= 500),
        "failures": sum(len(o.failures) for o in outcomes),
        "operations": [o.to_dict() for o in outcomes],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=150, help="cases per operation, mode and ids")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--databases", nargs="+", default=["sqlite", "postgresql"])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from tests.utils import answers

    runs, skipped = [], []
    for database in args.databases:
        if database == "postgresql" and not answers("127.0.0.1", 5432):
            skipped.append("postgresql: no server on 127.0.0.1:5432")
            continue
        for seed in args.seeds:
            run = run_one(database, examples=args.examples, seed=seed)
            runs.append(run)
            print(
                f"{database:10s} seed {seed}: {run['cases']:5d} cases in {run['seconds']:6.1f} s, "
                f"{run['server_errors']} server errors, {run['failures']} failures  {run['statuses']}",
                flush=True,
            )
            for o in run["operations"]:
                for failure in o["failures"]:
                    print(f"  {o['operation']} [{o['mode']}, {o['ids']} ids] {failure}")
    result = {
        "what": "schemathesis over every operation of the OpenAPI schema (tests/utils/fuzzing.py)",
        "setup": {"examples_per_operation_mode_and_ids": args.examples, "seeds": args.seeds},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "versions": versions(),
        "skipped": skipped,
        "totals": {
            "cases": sum(r["cases"] for r in runs),
            "server_errors": sum(r["server_errors"] for r in runs),
            "failures": sum(r["failures"] for r in runs),
        },
        "target_met": all(r["server_errors"] == 0 and r["failures"] == 0 for r in runs),
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fuzz.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"total: {result['totals']}; target met: {result['target_met']}")
    sys.exit(0 if result["target_met"] else 1)


if __name__ == "__main__":
    main()
