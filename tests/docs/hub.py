"""The Hub the manual's examples talk to (docs/guides/hub.md): the tests' local server speaking the
Hub's API (``tests/utils/fake_hub.py``), holding the repos the examples pull, and taking their
pushes with the token the service is given."""

from __future__ import annotations

from pathlib import Path

from engine.demo import HELDOUT, TRAIN
from tests.utils.fake_hub import FakeHub

TOKEN = "hf_docs_examples"
# the demo model under the repo id its weights come from on the Hub
MODEL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
# a dataset of the examples' own ("my-org" stands for the reader's namespace): a train and a test split
DATASET_REPO = "my-org/inventory"


def docs_hub(demo_model: Path) -> FakeHub:
    """A started fake Hub with the demo model's folder and a dataset of the demo's rows."""
    hub = FakeHub(token=TOKEN).start()
    hub.add_folder(MODEL_REPO, demo_model)
    train = TRAIN.read_text().splitlines()[:40]
    test = HELDOUT.read_text().splitlines()[:10]
    files = {
        "README.md": b"# inventory\n\nHow many of a fruit an inventory lists.\n",
        "data/train.jsonl": ("\n".join(train) + "\n").encode(),
        "data/test.jsonl": ("\n".join(test) + "\n").encode(),
    }
    hub.add(DATASET_REPO, files, kind="dataset")
    return hub


def hub_settings(hub: FakeHub) -> dict[str, str]:
    """The service's settings (and its CLI's) for this Hub: its address, the token, Git LFS (the
    fake Hub has no Xet)."""
    return {
        "ROUNDHOUSE_HUB_ENDPOINT": hub.url,
        "ROUNDHOUSE_HUB_TOKEN": TOKEN,
        "ROUNDHOUSE_HUB_XET": "0",
    }
