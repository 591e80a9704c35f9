"""browser sessions

Login links were the API key itself and worked forever; now a link holds a one-time token that
expires within minutes and is traded for a browser session bound to a key. One row is one link
and, once used, its session; only SHA-256 hashes of the token and the session cookie are stored.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 13:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "browser_sessions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("link_hash", sa.String(length=64), nullable=False),
        sa.Column("link_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("session_hash", sa.String(length=64), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("link_hash"),
        sa.UniqueConstraint("session_hash"),
    )
    with op.batch_alter_table("browser_sessions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_browser_sessions_key_id"), ["key_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("browser_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_browser_sessions_key_id"))

    op.drop_table("browser_sessions")
