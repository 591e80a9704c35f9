"""OpenAI's ``integrations`` of a fine-tuning job, as the ``tracking`` section of our jobs: a
``{"type": "wandb", "wandb": {"project", "name", "entity", "tags"}}`` entry logs the run to W&B
(``engine.tracking``; the API key comes from the settings). Our extension: ``wandb.mode``
("online" or "offline")."""

from __future__ import annotations

from typing import Any

from server.services.failures import Invalid

WANDB_FIELDS = ("project", "name", "entity", "tags", "mode")


def tracking_section(integrations: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The ``tracking`` section the integrations ask for ({} for none).

    Raises:
        Invalid: (``invalid_request``) an integration of another type, a second W&B one, or a
            W&B one without a project or with a field W&B's has not, naming it.
    """
    section: dict[str, Any] = {}
    for i, entry in enumerate(integrations or []):
        where = f"integrations[{i}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind != "wandb":
            raise Invalid(
                "invalid_request", f"{where}.type: {kind!r}: only 'wandb' is supported", param=where
            )
        if "wandb" in section:
            raise Invalid("invalid_request", f"{where}: one wandb integration per job", param=where)
        wandb = entry.get("wandb")
        if not isinstance(wandb, dict) or not wandb.get("project"):
            message = f"{where}.wandb.project: give the W&B project to log to"
            raise Invalid("invalid_request", message, param=f"{where}.wandb.project")
        unknown = sorted(set(wandb) - set(WANDB_FIELDS))
        if unknown:
            message = f"{where}.wandb.{unknown[0]}: not a W&B integration field ({', '.join(WANDB_FIELDS)})"
            raise Invalid("invalid_request", message, param=f"{where}.wandb.{unknown[0]}")
        section["wandb"] = {k: v for k, v in wandb.items() if v is not None}
    return section


def shown(config: dict[str, Any]) -> list[dict[str, Any]]:
    """A job's integrations as OpenAI shows them, from its stored config."""
    wandb = (config.get("tracking") or {}).get("wandb")
    if not wandb:
        return []
    fields = {k: wandb.get(k) for k in ("project", "name", "entity")} | {"tags": wandb.get("tags") or []}
    return [{"type": "wandb", "wandb": fields}]
