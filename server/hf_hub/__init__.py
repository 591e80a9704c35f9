"""The Hugging Face Hub as a source and destination: models and datasets pulled by name, checkpoints
pushed with a model card.

``client`` is the only module that imports ``huggingface_hub``; it runs in a child process whose
environment says exactly which Hub, token and offline mode apply (``child``), so the service's own
``HF_HUB_OFFLINE=1`` keeps guarding ``transformers`` while a pull a user asked for goes through.
``files`` picks what to fetch, ``card`` writes a pushed repo's model card, ``runner`` is the
worker's side (claim a transfer, run it), ``progress`` records a transfer's progress in its row.
"""
