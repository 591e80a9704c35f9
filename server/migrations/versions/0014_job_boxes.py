"""job boxes

A job on several hosts (``placement.hosts``): the hosts reserved for its run (``job_boxes``, one
row per host, a host in one row at most), and what the workers register for the rendezvous
(their advertised address and port, their NIC, its nominal speed, the rate last measured).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-09 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("address", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("rendezvous_port", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("interface", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("link_gbps", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("link_measured_gbps", sa.Float(), nullable=True))
    op.create_table(
        "job_boxes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("worker_id", sa.String(length=255), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("hostname"),
    )
    op.create_index(op.f("ix_job_boxes_job_id"), "job_boxes", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_job_boxes_job_id"), table_name="job_boxes")
    op.drop_table("job_boxes")
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("link_measured_gbps")
        batch_op.drop_column("link_gbps")
        batch_op.drop_column("interface")
        batch_op.drop_column("rendezvous_port")
        batch_op.drop_column("address")
