"""Helpers shared by the tests and the benchmarks (``bench/`` imports them too)."""

from tests.utils.databases import postgres_database
from tests.utils.processes import (
    LOGIN_LINE,
    ROOT,
    Process,
    answers,
    child_env,
    free_port,
    roundhouse,
    xdist_worker,
)

__all__ = [
    "LOGIN_LINE",
    "ROOT",
    "Process",
    "answers",
    "child_env",
    "free_port",
    "postgres_database",
    "roundhouse",
    "xdist_worker",
]
