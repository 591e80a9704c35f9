"""The earlier shapes of a ``method`` section, turned into today's: the one place that reads them.

Before each method owned its options, a ``method`` section was one flat model: every method's
fields in every section (a supervised job's stored config carried GRPO's ``group_size``), and
the choice also in a one-word form, ``kind`` ("lora"/"full" for supervised runs, or "dpo",
"orpo", "grpo") with ``dpo_tuning`` for what a preference method trains. API clients may still
send that form; jobs stored before are rewritten once by the database migration that calls
``upgrade`` (``server/migrations/versions/0013_method_options.py``).

``upgrade`` maps ``kind``/``dpo_tuning`` to ``objective``/``tuning`` (refusing a section whose
two forms contradict), and in a section of the earlier shape (one that names ``kind`` or
``dpo_tuning``) drops the flat model's fields that the chosen method does not own: they never
had an effect. A section of today's shape is left as it is, so a field its method does not own
is refused by validation. No torch, no pydantic model: the raw mapping in, a mapping out.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ConfigError

DEFAULT_OBJECTIVE = "sft"
# the one-word form of a supervised run: what trains
_TUNINGS = ("lora", "full")
# the fields of the earlier flat model that belong to one method or another (not the common ones)
FLAT_FIELDS = {
    "beta": ("dpo", "orpo", "grpo"),
    "grader": ("grpo",),
    "group_size": ("grpo",),
    "max_completion_tokens": ("grpo",),
    "temperature": ("grpo",),
    "top_p": ("grpo",),
    "epsilon": ("grpo",),
    "epsilon_high": ("grpo",),
    "loss_type": ("grpo",),
    "scale_rewards": ("grpo",),
    "num_iterations": ("grpo",),
}


def _kind_of(objective: str, kind: str) -> str:
    """The one-word form of a method: the objective, or for supervised runs what trains."""
    return kind if objective == DEFAULT_OBJECTIVE and kind in _TUNINGS else objective


def upgrade(raw: Any) -> Any:
    """A ``method`` section in today's shape (``raw`` itself when it is one, or not a mapping).

    Raises:
        ConfigError: ``kind`` contradicts ``objective`` or ``tuning``, or ``dpo_tuning``
            contradicts ``tuning`` (the field relative to the section: ``kind``, ``dpo_tuning``).
    """
    if not isinstance(raw, dict) or not ({"kind", "dpo_tuning"} & raw.keys()):
        return raw
    out = dict(raw)
    kind, dpo_tuning = out.pop("kind", None), out.pop("dpo_tuning", None)
    if dpo_tuning is not None and dpo_tuning not in _TUNINGS:
        raise ConfigError(
            "dpo_tuning", f'method.dpo_tuning={dpo_tuning!r}: must be "lora" or "full"', value=dpo_tuning
        )
    if kind is not None and "objective" not in out:
        out["objective"] = DEFAULT_OBJECTIVE if kind in _TUNINGS else kind
    objective = out.get("objective", DEFAULT_OBJECTIVE)
    if kind is not None and kind != _kind_of(str(objective), str(kind)):
        raise ConfigError(
            "kind",
            f"method.kind={kind!r} contradicts method.objective={objective!r}: give one of them",
            value=kind,
        )
    if "tuning" not in out:
        if objective == DEFAULT_OBJECTIVE and kind in _TUNINGS:
            out["tuning"] = kind
        elif dpo_tuning is not None:
            out["tuning"] = dpo_tuning
    elif dpo_tuning is not None and dpo_tuning != out["tuning"] and objective != DEFAULT_OBJECTIVE:
        raise ConfigError(
            "dpo_tuning",
            f"method.dpo_tuning={dpo_tuning!r} contradicts method.tuning={out['tuning']!r}: give one of them",
            value=dpo_tuning,
        )
    elif objective == DEFAULT_OBJECTIVE and kind is not None and kind != out["tuning"]:
        raise ConfigError(
            "kind",
            f"method.kind={kind!r} contradicts method.tuning={out['tuning']!r}: give one of them",
            value=kind,
        )
    for name, owners in FLAT_FIELDS.items():
        if name in out and objective not in owners:
            del out[name]
    if objective == "grpo" and out.get("grader", 0) is None:
        del out["grader"]  # the flat model's "no grader": GRPO then says it needs one
    return out
