"""job progress figures and deleted datasets

What the OpenAI-compatible API shows of a job beyond its step: ``trained_tokens`` (the tokens of
its steps' batches) and ``estimated_finish`` (when its run expects to end). A dataset that only
finished jobs use may be deleted: its file goes, its row stays for them with ``deleted_at`` set.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("trained_tokens", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("estimated_finish", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # a deleted dataset's row stays (jobs name it), as a dataset whose file is missing
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_column("deleted_at")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("estimated_finish")
        batch_op.drop_column("trained_tokens")
