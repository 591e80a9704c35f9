"""``roundhouse``'s dispatch: the engine's commands run on the engine's parser alone, the
service's on the whole one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server.cli import main
from tests.utils import ROOT, child_env

LLAMA = {  # a small Llama's config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "vocab_size": 1000,
}


def test_roundhouse_plan_loads_neither_torch_nor_the_service_settings(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    argv = ["plan", "--model", str(tmp_path), "--workers", "2", "--host-ram-gb", "64"]
    heavy = ["torch", "transformers", "server.settings", "pydantic_settings", "psutil"]
    code = (
        "import sys\n"
        "from server.cli import main\n"
        f"assert main({argv!r}) == 0\n"
        f"print(sorted(set({heavy!r}) & set(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=child_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LlamaForCausalLM: 6 layers (input, 4 blocks, output)" in out.stdout and "fits: yes" in out.stdout
    assert out.stdout.splitlines()[-1] == "[]"


def test_the_help_lists_the_engine_s_and_the_service_s_commands(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for command in ("plan", "train", "serve", "worker", "keys", "sweeps"):
        assert command in out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--memory-budget-gb" in capsys.readouterr().out
