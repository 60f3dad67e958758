"""Offline lm-eval tasks (eval/tasks) and the accuracy runner (modeling_kdsa.eval.accuracy) on the shipped checkpoint.

lm-eval runs from a temporary working directory, so a data path resolved against the CWD would fail here."""

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_without_the_package
from modeling_kdsa.eval import accuracy, synthetic
from modeling_kdsa.eval.make_data import SPLITS, TASKS, load_docs, make_docs

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "checkpoints" / "kdsa-tiny"
TASK_DIR = ROOT / "eval" / "tasks"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def load_train_tiny():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a shared 2-core CI box two OpenMP threads waiting for each other ran the same forward
    ~100x slower (measured, see eval/accuracy.py --threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(CHECKPOINT)


# ------------------------------------------------------------------------------------------------------- data


@pytest.mark.parametrize("split", list(SPLITS))
def test_shipped_data_is_regenerated_exactly_from_its_seed(split):
    for task in TASKS:
        assert load_docs(task, split) == make_docs(task, split), f"{task}_{split}.jsonl differs from make_data"


def test_docs_have_the_stated_distances_and_answers():
    for task, spec in TASKS.items():
        for doc in load_docs(task):
            words = doc["context"].split()
            if spec.compose is None:
                assert words[0] == synthetic.COPY and words[-1] == synthetic.COPY_SEP
                assert doc["target"].split() == words[1:-1]
                continue
            low, high = spec.distances
            assert low <= doc["distance"] <= high
            key_position = len(words) - 1 - doc["distance"]  # the needle key, `distance` tokens before the query
            assert words[key_position] == words[-1]
            value = int(words[key_position + 1][1:])
            expected = synthetic.successor(value) if spec.compose else value
            assert doc["target"] == synthetic.VALUES[expected]


def test_training_stream_shares_no_context_with_eval_docs():
    """300 training batches at every curriculum size (train_tiny.py checks every batch of the real run as it trains
    and refuses to save on any overlap)."""
    train_tiny = load_train_tiny()
    tokenizer = synthetic.build_tokenizer()
    held_out = train_tiny.held_out_signatures()
    assert len(held_out) == sum(len(load_docs(t, s)) for t in TASKS for s in SPLITS)  # all distinct
    rng = random.Random(0)
    for batch in range(300):
        size = 8 + 8 * (batch % 8)  # 8 .. 64, the eval sizes
        _, ids, _ = train_tiny.training_batch(rng, tokenizer, 16, {"key_value": size, "copy": size})
        for row in ids.tolist():
            assert synthetic.context_signature(tokenizer.convert_ids_to_tokens(row)) not in held_out


# ------------------------------------------------------------------------------------------------- lm-eval


def test_lm_eval_python_api_offline_matches_runner(model_and_tokenizer, tmp_path, monkeypatch):
    """HFLM with the model object; tasks from `include_path` while the CWD is elsewhere. lm-eval's acc must equal
    the runner's greedy exact match on the same docs (same tokens, same argmax: exact equality)."""
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tokenizer = model_and_tokenizer
    limit = 20
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=20, device="cpu")
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    tasks = ["kdsa_recall_far", "kdsa_compose", "kdsa_copy"]
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=limit, bootstrap_iters=0, log_samples=False
    )["results"]
    for task in tasks:
        docs = load_docs(task.removeprefix("kdsa_"))[:limit]
        expected = sum(accuracy.doc_correct(model, tokenizer, docs)) / limit
        assert results[task]["acc,none"] == pytest.approx(expected, abs=1e-12), task


@pytest.mark.slow
def test_lm_eval_cli_offline_with_remote_code(tmp_path):
    """The CLI command of docs/testing.md §4: `lm_eval --model hf` does not import this package, so the model comes
    from the remote code that `save_pretrained` writes. The CLI runs in a fresh Python where this package cannot be
    imported (tests/conftest.py `run_without_the_package`), from a temporary CWD, on a saved copy of the shipped
    checkpoint and a copy of the task folder (its data loader is a file of this checkout)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    model.save_pretrained(tmp_path / "kdsa-tiny")
    tokenizer.save_pretrained(tmp_path / "kdsa-tiny")
    shutil.copytree(TASK_DIR, tmp_path / "tasks", ignore=shutil.ignore_patterns("__pycache__"))
    argv = [
        "lm_eval", "--model", "hf",
        "--model_args", f"pretrained={tmp_path / 'kdsa-tiny'},trust_remote_code=True,dtype=float32",
        "--tasks", "kdsa_recall_mid", "--include_path", str(tmp_path / "tasks"), "--device", "cpu",
        "--batch_size", "10", "--limit", "10", "--output_path", str(tmp_path / "out"),
    ]  # fmt: skip
    script = f"sys.argv = {argv!r}\nfrom lm_eval.__main__ import cli_evaluate\ncli_evaluate()\n"
    result = run_without_the_package(script, cwd=tmp_path, HF_MODULES_CACHE=tmp_path / "modules", **OFFLINE)
    assert result.returncode == 0, result.stderr[-3000:]
    (output,) = list((tmp_path / "out").rglob("results_*.json"))
    acc = json.loads(output.read_text())["results"]["kdsa_recall_mid"]["acc,none"]
    docs = load_docs("recall_mid")[:10]
    assert acc == pytest.approx(sum(accuracy.doc_correct(model, tokenizer, docs)) / 10, abs=1e-12)


# ------------------------------------------------------------------------------------------- accuracy runner


def test_stepwise_scoring_equals_prefill_scoring(model_and_tokenizer):
    """The all-recurrent configuration (prompt token by token through the cache) against chunked prefill, both at
    the shipped index_topk: per-token logits agree to fp32 noise (2e-4: chunked vs recurrent KDA summation order
    through 4 layers), so the greedy verdicts agree on these docs."""
    model, tokenizer = model_and_tokenizer
    docs = load_docs("recall_far")[:6]
    ids = torch.tensor([tokenizer(d["context"]).input_ids for d in docs])
    prefill = accuracy._logits(model, ids, stepwise=False)
    stepwise = accuracy._logits(model, ids, stepwise=True)
    torch.testing.assert_close(stepwise, prefill, atol=2e-4, rtol=0)
    assert accuracy.doc_correct(model, tokenizer, docs, stepwise=True) == accuracy.doc_correct(model, tokenizer, docs)


def test_copy_partial_credit_matches_greedy_generation(model_and_tokenizer):
    """`target_hits` is teacher-forced; up to a doc's first miss that is what greedy decoding generates, so the
    correct prefix it reports must be exactly where `generate()` first leaves the target."""
    model, tokenizer = model_and_tokenizer
    docs = load_docs("copy")[:4]
    hits = accuracy.target_hits(model, tokenizer, docs)
    for doc, row in zip(docs, hits, strict=True):
        ids = tokenizer(doc["context"], return_tensors="pt").input_ids
        target = tokenizer(doc["target"], return_tensors="pt").input_ids[0]
        generated = model.generate(ids, max_new_tokens=len(target), do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
        leaves = (generated != target).tolist()
        assert (row.index(False) if False in row else len(row)) == (leaves.index(True) if True in leaves else len(row))
    assert all(len(row) == len(doc["target"].split()) for doc, row in zip(docs, hits, strict=True))
    # Two docs of 4 target tokens: 7 of 8 right; correct prefixes 2 and 4.
    credit = accuracy.partial_credit([[True, True, False, True], [True, True, True, True]])
    assert credit == {"token_accuracy": 7 / 8, "mean_correct_prefix": 3.0, "target_tokens": 4}


def test_check_flags_a_delta_beyond_tolerance():
    results = {"dense": {"recall_far": 0.90, "copy": 0.50}, "sparse_topk64": {"recall_far": 0.89, "copy": 0.50}}
    assert accuracy.check(results)["sparse_topk64"]["ok"]  # -0.01 within 0.02
    results["sparse_topk64"]["recall_far"] = 0.87  # -0.03
    report = accuracy.check(results)
    assert not report["sparse_topk64"]["ok"]
    assert report["sparse_topk64"]["delta"]["recall_far"] == pytest.approx(-0.03)
    assert "EXCEEDED" in accuracy.format_table(results)


def test_runner_command_writes_table_and_json(tmp_path, capsys):
    """`python -m modeling_kdsa.eval.accuracy` on a few docs: every configuration runs, references are added, the
    JSON holds accuracies and deltas, and the exit status is 0 exactly when every delta is within tolerance."""
    out = tmp_path / "accuracy.json"
    status = accuracy.main(["--tasks", "recall_far", "copy", "--limit", "6", "--json", str(out), "--threads", "1"])
    report = json.loads(out.read_text())
    assert set(report["configurations"]) == set(accuracy.CONFIGURATIONS)
    assert report["docs_per_task"] == {"recall_far": 6, "copy": 6}
    assert status == (0 if report["passed"] else 1)
    assert report["passed"] == all(entry["ok"] for entry in report["configurations"].values())
    recurrent = report["configurations"]["recurrent_topk64"]
    assert recurrent["reference"] == "sparse_topk64" and set(recurrent["delta"]) == {"recall_far", "copy"}
    assert 0.0 <= report["copy_partial_credit"]["token_accuracy"] <= 1.0
    assert "| recall_far |" in capsys.readouterr().out
