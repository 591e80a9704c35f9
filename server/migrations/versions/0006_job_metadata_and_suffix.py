"""job metadata and suffix

What the OpenAI-compatible API (``/v1/fine_tuning/jobs``) keeps of a job beyond its config: the
caller's ``metadata`` (up to 16 string pairs, null when none was given) and the ``suffix`` its
fine-tuned model's name carries.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 18:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("metadata", sa.JSON(none_as_null=True), nullable=True))
        batch_op.add_column(sa.Column("suffix", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("suffix")
        batch_op.drop_column("metadata")
