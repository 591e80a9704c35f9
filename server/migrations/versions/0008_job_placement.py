"""job placement

Where a job may run: ``{"host": name | null, "gpus": count | null}`` (``server.services.placement``);
null for anywhere.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 19:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("placement", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("placement")
