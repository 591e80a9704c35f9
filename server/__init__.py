"""Roundhouse's service: the REST API, its database, and the Celery worker that owns the GPUs."""

__version__ = "0.1.0"
