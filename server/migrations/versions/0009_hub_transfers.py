"""hub transfers

Pulls from and pushes to the Hugging Face Hub, run by workers (one row each, with its progress and
lease), and where a dataset came from when it was pulled (``datasets.source``).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "hub_transfers",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("repo_id", sa.String(length=255), nullable=False),
        sa.Column("revision", sa.String(length=255), nullable=True),
        sa.Column("active_key", sa.String(length=600), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("bytes_total", sa.BigInteger(), nullable=False),
        sa.Column("bytes_done", sa.BigInteger(), nullable=False),
        sa.Column("bytes_per_s", sa.Float(), nullable=True),
        sa.Column("progress_seq", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("worker_id", sa.String(length=255), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("active_key"),
    )
    with op.batch_alter_table("hub_transfers", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_hub_transfers_repo_id"), ["repo_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_hub_transfers_status"), ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_hub_transfers_created_at"), ["created_at"], unique=False)
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("source", sa.JSON(none_as_null=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_column("source")
    with op.batch_alter_table("hub_transfers", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_hub_transfers_created_at"))
        batch_op.drop_index(batch_op.f("ix_hub_transfers_status"))
        batch_op.drop_index(batch_op.f("ix_hub_transfers_repo_id"))
    op.drop_table("hub_transfers")
