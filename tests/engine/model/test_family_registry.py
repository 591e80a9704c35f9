"""The facts other layers keep about a family are keyed by its registered name: its GGUF export
and its measured activation coefficients. A registered family lacking an entry it needs, or an
entry naming no registered family, fails here."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from engine.export.gguf_families import GGUF_FAMILIES, family_for
from engine.model.families import FAMILIES, FamilySpec
from engine.planner.activation_table import TABLE
from engine.planner.activations import measured_families


def registry_gaps(
    families: Mapping[str, FamilySpec], gguf: Mapping[str, Any], table: Mapping[str, Any]
) -> list[str]:
    """What is missing or stray between the family registry and the tables keyed by it."""
    gaps = [f"GGUF entry {name} names no registered family" for name in gguf if name not in families]
    gaps += [f"activation entry {name} names no registered family" for name in table if name not in families]
    for name, spec in families.items():
        if spec.no_gguf is None and name not in gguf:
            gaps.append(f"{name} has no GGUF entry and no no_gguf reason")
        if spec.no_gguf is not None and name in gguf:
            gaps.append(f"{name} has a GGUF entry and a no_gguf reason")
        if spec.unmeasured is None and name not in table:
            gaps.append(f"{name} has no activation entry and no unmeasured reason")
        if spec.unmeasured is not None and name in table:
            gaps.append(f"{name} has an activation entry and an unmeasured reason")
    return gaps


def test_every_family_has_the_entries_it_needs_and_every_entry_a_family() -> None:
    assert registry_gaps(FAMILIES, GGUF_FAMILIES, TABLE) == []
    # the families exported and measured today
    assert set(GGUF_FAMILIES) == set(FAMILIES) - {
        "Qwen3MoeForCausalLM",
        "GptOssForCausalLM",
        "DeepseekV3ForCausalLM",
    }
    assert measured_families("bfloat16") == set(FAMILIES) - {"GptOssForCausalLM", "DeepseekV3ForCausalLM"}


def test_a_family_registered_without_its_entries_or_an_entry_without_its_family_is_caught() -> None:
    house = FamilySpec("HouseForCausalLM")
    families = dict(FAMILIES) | {house.architecture: house}
    assert registry_gaps(families, GGUF_FAMILIES, TABLE) == [
        "HouseForCausalLM has no GGUF entry and no no_gguf reason",
        "HouseForCausalLM has no activation entry and no unmeasured reason",
    ]
    excused = FamilySpec("HouseForCausalLM", no_gguf="not yet", unmeasured="not yet")
    assert registry_gaps(dict(FAMILIES) | {house.architecture: excused}, GGUF_FAMILIES, TABLE) == []
    stray = dict(GGUF_FAMILIES) | {"MambaForCausalLM": GGUF_FAMILIES["LlamaForCausalLM"]}
    assert registry_gaps(FAMILIES, stray, dict(TABLE) | {"MambaForCausalLM": {}}) == [
        "GGUF entry MambaForCausalLM names no registered family",
        "activation entry MambaForCausalLM names no registered family",
    ]
    # a registered family that says why it has no GGUF entry and still has one
    both = dict(FAMILIES) | {"LlamaForCausalLM": excused}
    assert "LlamaForCausalLM has a GGUF entry and a no_gguf reason" in registry_gaps(
        both, GGUF_FAMILIES, TABLE
    )


def test_a_gguf_export_of_a_family_without_one_says_why() -> None:
    config = SimpleNamespace(architectures=["GptOssForCausalLM"])
    with pytest.raises(ValueError) as exc:
        family_for(config)
    assert str(exc.value).startswith(
        f"GGUF export: GptOssForCausalLM cannot be exported yet ({FAMILIES['GptOssForCausalLM'].no_gguf}); "
    )
