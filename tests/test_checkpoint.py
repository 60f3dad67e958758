"""The shipped tiny checkpoint (checkpoints/kdsa-tiny): contents, tokenizer, what it has learned, and Hub-style loading
with remote code where this package cannot be imported."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from modeling_kdsa.eval import accuracy, synthetic
from modeling_kdsa.eval.make_data import load_docs
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.dynamic_module_utils import check_imports, get_imports, get_relative_import_files

from modeling_kdsa import KDSAForCausalLM

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "kdsa-tiny"
DRAFT = ROOT / "checkpoints" / "kdsa-tiny-draft"


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: two OpenMP threads on a shared 2-core box ran ~100x slower (eval/accuracy.py --threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(CHECKPOINT)


@pytest.mark.parametrize("folder", [CHECKPOINT, DRAFT], ids=["target", "draft"])
def test_folder_carries_weights_config_remote_code_tokenizer_and_card(folder):
    files = {p.name for p in folder.iterdir()}
    for name in ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "README.md", "training.json", "modeling_kdsa.py",
                 "configuration_kdsa.py"]:  # fmt: skip
        assert name in files, name
    assert (folder / "model.safetensors").stat().st_size <= 20 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kdsa.KDSAForCausalLM"
    assert config["auto_map"]["AutoConfig"] == "configuration_kdsa.KDSAConfig"
    # transformers' remote-code loader fetches the modules it finds imported as `from .module import`: every module
    # of the folder must be among them (the device backends' too). It then requires every package those modules
    # import to be installed, so the device backends' packages (fla, triton, torch_npu) must stay out of its sight.
    modules = {folder / "modeling_kdsa.py", folder / "configuration_kdsa.py"}
    for module in list(modules):
        modules.update(Path(path) for path in get_relative_import_files(module))
    assert modules == set(folder.glob("*.py"))
    for module in modules:
        assert not {"fla", "triton", "torch_npu"} & set(get_imports(module)), module.name
        check_imports(module)
    card = (folder / "README.md").read_text()
    assert "## Results" in card and "## Training" in card and "seed" in card


def test_mixed_layers_attn_res_and_moe(model):
    config = model.config
    assert set(config.layer_types) == {"linear_attention", "indexed_attention"}
    assert config.attn_res_block_size > 0 and "sparse" in config.mlp_layer_types
    assert 1e6 <= sum(p.numel() for p in model.parameters()) <= 5e6


def test_tokenizer_round_trips_words(tokenizer):
    text = "pairs k1 v5 k127 v63 ? k127"
    ids = tokenizer(text).input_ids
    assert ids == [synthetic.VOCAB.index(w) for w in text.split()]  # one word, one token, no BOS
    assert tokenizer.decode(ids) == " " + text  # every word carries its leading space (eval/synthetic.py)
    assert tokenizer.decode(ids[3:]) == " " + " ".join(text.split()[3:])
    assert len(tokenizer) == len(synthetic.VOCAB)


def test_recall_beyond_the_sparse_window_and_sparse_matches_dense(model, tokenizer):
    """The claim of the README: with `index_topk = 64`, needles 65-129 tokens back (out of reach of any 64-token
    window) are recalled far above chance (1/64), and sparse stays within 2 points of dense on the same docs.
    100 docs: the 0.75 floor sits below the measured accuracy (0.89 on all 300, README table) and ~50x chance."""
    docs = load_docs("recall_far")[:100]
    assert min(d["distance"] for d in docs) > 64
    sparse = accuracy.doc_correct(accuracy.set_index_topk(model, 64), tokenizer, docs)
    dense = accuracy.doc_correct(accuracy.set_index_topk(model, model.config.max_position_embeddings), tokenizer, docs)
    accuracy.set_index_topk(model, 64)
    assert sum(sparse) / len(docs) >= 0.75
    assert abs(sum(sparse) - sum(dense)) / len(docs) <= 0.02


def test_generate_answers_a_recall_question(model, tokenizer):
    doc = load_docs("recall_far")[0]
    ids = tokenizer(doc["context"], return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=model.config.pad_token_id)
    assert tokenizer.decode(out[0, ids.shape[1] :]) == " " + doc["target"]


def test_resaved_folder_loads_with_remote_code_where_the_package_is_missing(model, tokenizer, tmp_path):
    """`save_pretrained` of the loaded model + tokenizer (what `push_to_hub` uploads) gives a folder that a Python
    without this package loads with trust_remote_code=True: same class of remote module, bit-identical logits, and
    the same tokens. The shipped folder itself is checked the same way."""
    resaved = tmp_path / "resaved"
    model.save_pretrained(resaved)
    tokenizer.save_pretrained(resaved)
    doc = load_docs("recall_mid")[0]
    ids = tokenizer(doc["context"], return_tensors="pt").input_ids
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["modeling_kdsa"] = None  # any `import modeling_kdsa` now raises ImportError
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        for name, folder in [("shipped", {str(CHECKPOINT)!r}), ("resaved", {str(resaved)!r})]:
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            tokenizer = AutoTokenizer.from_pretrained(folder)
            assert tokenizer({doc["context"]!r}, return_tensors="pt").input_ids.equal(ids)
            torch.save(model(ids).logits, {str(tmp_path)!r} + f"/{{name}}.pt")
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert type(model) is KDSAForCausalLM  # this side: the package's class
    with torch.no_grad():
        expected = model(ids).logits
    for name in ("shipped", "resaved"):
        assert torch.equal(torch.load(tmp_path / f"{name}.pt"), expected), name


@pytest.mark.parametrize("folder", [CHECKPOINT, DRAFT], ids=["target", "draft"])
def test_card_example_runs_without_the_package_and_without_a_prompt(folder, tmp_path):
    """The card's snippet, as written, where the package is missing and stdin is closed: AutoTokenizer loads the
    config first, and a config with `auto_map` makes transformers ask "Do you wish to run the custom code? [y/N]"
    unless trust_remote_code is given."""
    card = (folder / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.DOTALL).group(1)
    script = 'import sys\nsys.modules["modeling_kdsa"] = None\n' + snippet
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Do you wish" not in result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == " v9"


@pytest.mark.parametrize("folder", [CHECKPOINT, DRAFT], ids=["target", "draft"])
def test_shipped_remote_code_is_the_package_code(folder):
    """The checkpoints' remote-code files must be today's model files, or `trust_remote_code=True` users would run
    stale code: run `python scripts/refresh_remote_code.py` whenever a file under modeling_kdsa/ changes."""
    package = ROOT / "modeling_kdsa"
    shipped = sorted(folder.glob("*.py"))
    expected = {p.name for p in package.glob("*.py")} - {"__init__.py"}
    assert {p.name for p in shipped} == expected, "run scripts/refresh_remote_code.py"
    for path in shipped:
        assert path.read_bytes() == (package / path.name).read_bytes(), f"{path.name} differs from the package's"


# ------------------------------------------------------------------------------------------------- the draft


@pytest.fixture(scope="module")
def draft():
    return AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()


def test_draft_is_smaller_and_shares_the_tokenizer(model, draft):
    assert (DRAFT / "tokenizer.json").read_bytes() == (CHECKPOINT / "tokenizer.json").read_bytes()
    assert draft.config.vocab_size == model.config.vocab_size
    assert draft.config.num_hidden_layers < model.config.num_hidden_layers
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in model.parameters()) / 2


def test_speculative_decoding_with_the_shipped_models_equals_plain_greedy(model, draft, tokenizer):
    """The README's demo on two copy prompts (66 tokens; generation crosses the 128-token page boundary):
    assisted by the shipped draft and prompt lookup both return plain greedy's tokens."""
    greedy = dict(max_new_tokens=synthetic.EVAL_COPY_LENGTH, do_sample=False, pad_token_id=model.config.pad_token_id)
    for doc in load_docs("copy")[:2]:
        ids = tokenizer(doc["context"], return_tensors="pt").input_ids
        plain = model.generate(ids, **greedy)
        assert torch.equal(model.generate(ids, assistant_model=draft, **greedy), plain)
        assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=10, **greedy), plain)
