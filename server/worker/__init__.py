"""The GPU worker: a Celery worker (concurrency 1) whose task supervises a training child process."""
