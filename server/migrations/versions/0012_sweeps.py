"""sweeps

A sweep (``sweeps``) searches a job's hyperparameters; its trials are ordinary jobs that name it
(``jobs.sweep_id``, set to null when the sweep is deleted).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("trials", sa.JSON(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sweeps_created_at", "sweeps", ["created_at"])
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sweep_id", sa.String(length=32), nullable=True))
        batch_op.create_index("ix_jobs_sweep_id", ["sweep_id"])
        batch_op.create_foreign_key(
            "fk_jobs_sweep_id_sweeps", "sweeps", ["sweep_id"], ["id"], ondelete="SET NULL"
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_constraint("fk_jobs_sweep_id_sweeps", type_="foreignkey")
        batch_op.drop_index("ix_jobs_sweep_id")
        batch_op.drop_column("sweep_id")
    op.drop_index("ix_sweeps_created_at", table_name="sweeps")
    op.drop_table("sweeps")
