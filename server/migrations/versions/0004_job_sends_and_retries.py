"""job sends and retries

A job remembers when its message last went to the broker (``sent_at``, empty while a send is
pending) and how many went (``sends``), so a worker can send again the queued jobs whose message
the broker lost; and how many times its training process was restarted after being killed by a
signal (``retries``). Jobs queued before this migration count as never sent: the next worker
sends them once more (a job already claimed ignores the duplicate).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 13:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("sends", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("retries", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("retries")
        batch_op.drop_column("sends")
        batch_op.drop_column("sent_at")
