"""``/v1``: the OpenAI-compatible fine-tuning API (files, fine-tuning jobs, models) over the same
datasets, jobs, keys and workers as ``/api``. Its errors come in OpenAI's shape (``server/errors.py``)."""
