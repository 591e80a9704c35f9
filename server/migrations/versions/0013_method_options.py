"""method options

Each training method owns its options (``engine.methods``): a job's stored ``method`` section
holds the common fields and its own method's, with ``objective`` and ``tuning`` (no longer the
one-word ``kind`` and ``dpo_tuning``, nor every other method's fields). Stored jobs, and the job
request a sweep keeps, are rewritten once by ``engine.methods.legacy.upgrade``; a section that
cannot be (two forms that contradict, which validation refused when it was stored) is left as it
is, and reading it fails as it would have.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-08 12:00:00.000000
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

from engine import ConfigError
from engine.methods import upgrade as upgrade_method

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def _upgraded(section: Any) -> Any:
    try:
        return upgrade_method(section)
    except ConfigError:
        return section


def upgrade() -> None:
    bind = op.get_bind()
    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("config", sa.JSON))
    for ident, config in bind.execute(sa.select(jobs.c.id, jobs.c.config)).all():
        if isinstance(config, dict) and isinstance(config.get("method"), dict):
            method = _upgraded(config["method"])
            if method != config["method"]:
                bind.execute(
                    jobs.update().where(jobs.c.id == ident).values(config={**config, "method": method})
                )
    sweeps = sa.table("sweeps", sa.column("id", sa.String), sa.column("spec", sa.JSON))
    for ident, spec in bind.execute(sa.select(sweeps.c.id, sweeps.c.spec)).all():
        job = spec.get("job") if isinstance(spec, dict) else None
        if isinstance(job, dict) and isinstance(job.get("method"), dict):
            method = _upgraded(job["method"])
            if method != job["method"]:
                new = {**spec, "job": {**job, "method": method}}
                bind.execute(sweeps.update().where(sweeps.c.id == ident).values(spec=new))


def downgrade() -> None:
    """Nothing to undo: today's shape is one the earlier code read too (objective and tuning)."""
