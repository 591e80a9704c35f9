"""Alembic environment: migrations run on the connection ``server.db.migrate`` hands over."""

from __future__ import annotations

from alembic import context

from server.tables import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through server.db.migrate (it passes the connection)")
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
