"""worker inference service

Where a worker's inference service answers (``inference_url``) and the token it takes
(``inference_token``): the API forwards completions there, the supervisor tells it when a job
takes the devices. Null for a worker that runs none (an older one).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("inference_url", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("inference_token", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("inference_token")
        batch_op.drop_column("inference_url")
