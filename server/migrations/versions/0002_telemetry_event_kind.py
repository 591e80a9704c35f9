"""telemetry event kind

The worker's GPU/host samples were stored as ``metrics`` events without a step; they have their
own kind, ``telemetry``, now.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 12:25:16.000000
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE job_events SET kind = 'telemetry' WHERE kind = 'metrics' AND step IS NULL")


def downgrade() -> None:
    op.execute("UPDATE job_events SET kind = 'metrics' WHERE kind = 'telemetry'")
