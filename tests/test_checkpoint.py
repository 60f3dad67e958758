"""The shipped tiny checkpoint (checkpoints/kdsa-tiny): contents (weights, config, tokenizer and card, no code),
tokenizer, what it has learned, and Hub-style loading: a folder written by `save_pretrained` carries the model's code
and loads with remote code in a fresh Python where this package cannot be imported."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_without_the_package
from modeling_kdsa.eval import accuracy, synthetic
from modeling_kdsa.eval.make_data import load_docs
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.dynamic_module_utils import check_imports, get_imports, get_relative_import_files

from modeling_kdsa import KDSAForCausalLM

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "kdsa-tiny"
DRAFT = ROOT / "checkpoints" / "kdsa-tiny-draft"
PACKAGE = ROOT / "modeling_kdsa"


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
def test_folder_carries_weights_config_tokenizer_and_card(folder):
    files = {p.name for p in folder.iterdir()}
    for name in ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "README.md", "training.json"]:  # fmt: skip
        assert name in files, name
    assert (folder / "model.safetensors").stat().st_size <= 20 * 2**20
    card = (folder / "README.md").read_text()
    assert "## Results" in card and "## Training" in card and "seed" in card


def test_checkpoints_hold_no_code():
    """Every folder under checkpoints/ holds weights, config, tokenizer and card: no copy of the model files and no
    `auto_map` pointing at one. The code a Hub user runs is what `save_pretrained` / `push_to_hub` write (below)."""
    folders = sorted(p for p in (ROOT / "checkpoints").iterdir() if p.is_dir())
    assert {CHECKPOINT, DRAFT} <= set(folders)
    for folder in folders:
        assert not [p.name for p in folder.rglob("*.py")], folder.name
        assert "auto_map" not in json.loads((folder / "config.json").read_text()), folder.name
    assert json.loads((CHECKPOINT / "config.json").read_text())["num_mtp_layers"] == 1  # it ships an MTP layer


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


@pytest.fixture(scope="module")
def saved(model, tokenizer, tmp_path_factory):
    """What `push_to_hub` uploads: `save_pretrained` of the loaded shipped model and of its tokenizer."""
    folder = tmp_path_factory.mktemp("hub") / "kdsa-tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_save_pretrained_writes_every_module_the_model_imports(saved):
    """transformers' remote-code loader fetches the modules it finds imported as `from .module import`, starting at
    the `auto_map` files: `save_pretrained` must write all of them (mtp.py and speculative.py included), as the
    package's own bytes. It then requires every package those modules import to be installed, so the device
    backends' packages (fla, triton, torch_npu) must stay out of its sight."""
    config = json.loads((saved / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_kdsa.KDSAConfig", "AutoModelForCausalLM": "modeling_kdsa.KDSAForCausalLM"
    }  # fmt: skip
    assert config["num_mtp_layers"] == 1
    modules = {PACKAGE / "modeling_kdsa.py", PACKAGE / "configuration_kdsa.py"}
    for module in list(modules):
        modules.update(Path(path) for path in get_relative_import_files(module))
    assert {"mtp.py", "speculative.py", "cache.py", "kernels.py"} <= {p.name for p in modules}
    assert {p.name for p in saved.glob("*.py")} == {p.name for p in modules}
    for module in modules:
        assert (saved / module.name).read_bytes() == module.read_bytes(), module.name
        assert not {"fla", "triton", "torch_npu"} & set(get_imports(saved / module.name)), module.name
        check_imports(saved / module.name)


def test_saved_folder_generates_the_same_tokens_by_remote_code_without_the_package(model, tokenizer, saved, tmp_path):
    """The saved folder, loaded with `trust_remote_code=True` in a fresh Python where this package cannot be imported
    (tests/conftest.py `run_without_the_package`), is transformers' remote module and gives the in-process model's
    logits and its MTP layer's logits bit for bit, and its 16 greedy tokens, both plain and with the shipped MTP layer
    drafting (`use_mtp=True`). Greedy MTP decoding returns the target's tokens whatever the drafts are, so the MTP
    layer's own logits are what would show a remote MTP layer that computes something else."""
    doc = load_docs("recall_mid")[0]
    ids = tokenizer(doc["context"], return_tensors="pt").input_ids
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        torch.set_num_threads(1)
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        model = AutoModelForCausalLM.from_pretrained({str(saved)!r}, trust_remote_code=True, dtype=torch.float32)
        model.eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        assert model.mtp is not None
        tokenizer = AutoTokenizer.from_pretrained({str(saved)!r}, trust_remote_code=True)
        assert tokenizer({doc["context"]!r}, return_tensors="pt").input_ids.equal(ids)
        greedy = dict(max_new_tokens=16, do_sample=False, pad_token_id=model.config.pad_token_id)
        with torch.no_grad():
            hidden = model.model(ids).last_hidden_state
            mtp_logits = model.mtp.logits(0, model.mtp(0, hidden[:, :-1], ids[:, 1:]))
            out = dict(logits=model(ids).logits, mtp_logits=mtp_logits, plain=model.generate(ids, **greedy),
                       mtp=model.generate(ids, use_mtp=True, **greedy))
        torch.save(out, {str(tmp_path / "remote.pt")!r})
        """
    )
    result = run_without_the_package(script, cwd=tmp_path, HF_MODULES_CACHE=tmp_path / "modules")
    assert result.returncode == 0, result.stderr[-3000:]
    assert type(model) is KDSAForCausalLM  # this side: the package's class
    remote = torch.load(tmp_path / "remote.pt")
    greedy = dict(max_new_tokens=16, do_sample=False, pad_token_id=model.config.pad_token_id)
    with torch.no_grad():
        assert torch.equal(remote["logits"], model(ids).logits)
        hidden = model.model(ids).last_hidden_state
        assert torch.equal(remote["mtp_logits"], model.mtp.logits(0, model.mtp(0, hidden[:, :-1], ids[:, 1:])))
        plain = model.generate(ids, **greedy)
        assert plain.shape[1] == ids.shape[1] + 16
        assert torch.equal(remote["plain"], plain)
        assert torch.equal(remote["mtp"], model.generate(ids, use_mtp=True, **greedy))


def test_the_fresh_process_catches_a_leak_of_the_package(tmp_path):
    """The guard of `run_without_the_package` fails where code of the checkout gets in: here a package file
    imported by its path (what a sys.path entry of the checkout would allow)."""
    result = run_without_the_package("import torch\n", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    leak = textwrap.dedent(
        f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("kdsa_norms", {str(PACKAGE / "norms.py")!r})
        sys.modules["kdsa_norms"] = importlib.util.module_from_spec(spec)
        """
    )
    result = run_without_the_package(leak, cwd=tmp_path)
    assert result.returncode != 0 and "loaded from the checkout: kdsa_norms" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("folder", [CHECKPOINT, DRAFT], ids=["target", "draft"])
def test_card_example_runs_as_written_and_without_a_prompt(folder):
    """The card's snippet, as written (it imports this package: the folder carries no code), with stdin closed: no
    "Do you wish to run the custom code? [y/N]" question, and it prints the answer."""
    card = (folder / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.DOTALL).group(1)
    assert "trust_remote_code" not in snippet
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", snippet], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Do you wish" not in result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == " v9"


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
