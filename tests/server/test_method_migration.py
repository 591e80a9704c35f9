"""Migration 0013: stored ``method`` sections of the earlier flat shape become their method's
options (``engine.methods.legacy``), read back by today's ``TrainConfig``."""

from __future__ import annotations

import json

from engine.config import TrainConfig

# what the earlier code stored: every method's fields in every section, the one-word form too
FLAT = {
    "objective": "dpo",
    "tuning": "full",
    "kind": "dpo",
    "dpo_tuning": "full",
    "beta": 0.3,
    "lora_r": 16,
    "lora_alpha": 32.0,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "v_proj"],
    "target_parameters": [],
    "base_bits": 16,
    "grader": None,
    "group_size": 4,
    "max_completion_tokens": 64,
    "temperature": 1.0,
    "top_p": 1.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "loss_type": "grpo",
    "scale_rewards": True,
    "num_iterations": 1,
}


def test_migration_0013_gives_each_job_its_methods_options(database_url: str) -> None:
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import text

    from server.db import MIGRATIONS, make_engine

    engine = make_engine(database_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    sft = {**FLAT, "objective": "sft", "tuning": "lora", "kind": "lora", "dpo_tuning": "lora", "beta": 0.1}
    configs = {
        "dpo": {"data": {"train": "t.jsonl"}, "method": FLAT},
        "sft": {"data": {"train": "t.jsonl"}, "method": sft},
        "new": {"data": {"train": "t.jsonl"}, "method": {"objective": "orpo", "beta": 0.2}},
    }
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0012")
        conn.execute(
            text(
                "INSERT INTO datasets (id, name, filename, path, format, rows, size_bytes, sha256,"
                " created_at) VALUES ('d1', 'd', 'train.jsonl', 'datasets/d1/train.jsonl', 'preference', 1,"
                " 1, 'x', CURRENT_TIMESTAMP)"
            )
        )
        for ident, config in configs.items():
            conn.execute(
                text(
                    "INSERT INTO jobs (id, name, status, base_model, dataset_id, config, output_dir, step,"
                    " attempts, sends, retries, created_at) VALUES (:id, 'j', 'succeeded', 'tiny', 'd1',"
                    " :config, :out, 0, 1, 1, 0, CURRENT_TIMESTAMP)"
                ),
                {"id": ident, "config": json.dumps(config), "out": f"runs/{ident}"},
            )
        command.upgrade(cfg, "head")
        stored = {
            ident: json.loads(config) if isinstance(config, str) else config
            for ident, config in conn.execute(text("SELECT id, config FROM jobs")).all()
        }
    engine.dispose()
    dpo, sft_method = stored["dpo"]["method"], stored["sft"]["method"]
    assert {"kind", "dpo_tuning", "group_size", "grader"}.isdisjoint(dpo)
    assert (dpo["objective"], dpo["tuning"], dpo["beta"]) == ("dpo", "full", 0.3)
    assert {"kind", "dpo_tuning", "beta", "group_size"}.isdisjoint(sft_method) and sft_method[
        "tuning"
    ] == "lora"
    assert stored["new"]["method"] == configs["new"]["method"]  # today's shape: as it was
    # and each reads back as its method's options
    assert type(TrainConfig.parse(stored["dpo"]).method).__name__ == "DpoOptions"
    assert TrainConfig.parse(stored["sft"]).method.lora_r == 16
    # the earlier code's dump does not validate as today's shape without the migration
    assert TrainConfig.parse(configs["dpo"]).method.beta == 0.3  # the legacy form is still read
