"""storage keys

Rows name stored files by storage key (``server.storage``), not by host path: a dataset
``datasets/<id>/<file>``, a job's folder ``runs/<job id>``, a checkpoint
``runs/<job id>/checkpoints/step_000123``, an evaluation's result
``runs/<job id>/checkpoints/step_000123/evaluations/<id>.json``. An absolute path is turned into
its key by the layout under ROUNDHOUSE_HOME (the part from ``datasets/`` or ``runs/`` on), so
a home moved or mounted elsewhere converts too; a path in no such place is left as it was.
The downgrade puts the home folder (``cfg.attributes["home"]``, else the process's settings)
back in front of each key.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 19:05:00.000000
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import sqlalchemy as sa
from alembic import context, op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# (table, key column, column, the layout's top folder, parts of a key)
COLUMNS = (
    ("datasets", "id", "path", "datasets", 3),
    ("jobs", "id", "output_dir", "runs", 2),
    ("checkpoints", "id", "path", "runs", 4),
    ("evaluations", "id", "path", "runs", 6),
)


def to_key(value: str, top: str, parts: int) -> str | None:
    """The key of an absolute path whose last ``parts`` parts start at ``top``; None otherwise."""
    path = PurePosixPath(value)
    if not path.is_absolute() or len(path.parts) <= parts or path.parts[-parts] != top:
        return None
    tail = path.parts[-parts:]
    return None if any(p in ("", ".", "..") for p in tail) else "/".join(tail)


def _rewrite(convert: object) -> None:
    bind = op.get_bind()
    for table, ident, column, top, parts in COLUMNS:
        rows = bind.execute(sa.text(f"SELECT {ident}, {column} FROM {table}")).all()
        for row_id, value in rows:
            new = convert(value, top, parts) if value is not None else None  # type: ignore[operator]
            if new is not None and new != value:
                bind.execute(
                    sa.text(f"UPDATE {table} SET {column} = :value WHERE {ident} = :id"),
                    {"value": new, "id": row_id},
                )


def upgrade() -> None:
    _rewrite(to_key)


def downgrade() -> None:
    home = context.config.attributes.get("home")
    if home is None:
        from server.settings import get_settings

        home = get_settings().home
    root = Path(home).resolve()

    def to_path(value: str, top: str, parts: int) -> str | None:
        return None if Path(value).is_absolute() else str(root.joinpath(*PurePosixPath(value).parts))

    _rewrite(to_path)
