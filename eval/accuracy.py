"""Accuracy checks: the same weights under several configurations, accuracy per task and the delta to a reference.

    python -m modeling_kdsa.eval.accuracy                       # shipped checkpoint, every configuration
    python -m modeling_kdsa.eval.accuracy --checkpoint DIR --configs dense sparse_topk64 --json out.json

Prints a table and writes JSON; exits 1 when a delta exceeds its configuration's stated tolerance.

Metric: the lm-eval `acc` of our `loglikelihood` tasks (`eval/tasks/`): a doc counts when every target token is the
greedy (argmax) prediction given the context and the target tokens before it — exact match under greedy decoding.
Computed here directly over the same JSONL docs (tests check it equals lm-eval's number), so that configurations
lm-eval's HF wrapper cannot express — the prompt run token by token through the cache — are scored the same way.

Add a configuration by adding a `Configuration` to `CONFIGURATIONS` (quantization and CP × TP come later): `prepare`
turns a freshly loaded model into the configuration under test; `reference` names the configuration it is compared
with; `tolerance` is the largest allowed accuracy drop (a fraction: 0.02 = 2 points), None = reported only.
"""

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .make_data import TASKS, load_docs

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "kdsa-tiny"
BATCH_SIZE = 50


def set_index_topk(model, index_topk: int):
    """Every DSA layer selects `index_topk` keys. A value >= the context length makes the layer dense (the DSA
    layer equals dense causal MLA when the context fits in `index_topk`, tested in tests/test_dsa.py)."""
    model.config.index_topk = index_topk
    for module in model.modules():
        if hasattr(module, "indexer") and hasattr(module, "index_topk"):
            module.index_topk = index_topk
    return model


@dataclass(frozen=True)
class Configuration:
    description: str
    prepare: Callable  # model -> model
    stepwise: bool = False  # run the prompt token by token through the cache (recurrent KDA, decode-path DSA)
    reference: str | None = None
    tolerance: float | None = None


def _topk(index_topk: int) -> Callable:
    return lambda model: set_index_topk(model, index_topk)


CONFIGURATIONS = {
    "dense": Configuration(
        "DSA dense (index_topk = max positions), KDA chunked prefill: the reference", lambda m: set_index_topk(
            m, m.config.max_position_embeddings)),
    "sparse_topk64": Configuration("DSA top-64 (the shipped config)", _topk(64), reference="dense", tolerance=0.02),
    "sparse_topk32": Configuration("DSA top-32 (below the trained budget)", _topk(32), reference="dense"),
    "sparse_topk16": Configuration("DSA top-16 (below the trained budget)", _topk(16), reference="dense"),
    # The KDA layer runs chunked for a prompt and recurrent for one-token steps; feeding the prompt one token at a
    # time through the cache gives the all-recurrent model (and DSA's decode path) with no code change.
    "recurrent_topk64": Configuration(
        "prompt token by token through the cache: recurrent KDA, DSA decode path, top-64", _topk(64),
        stepwise=True, reference="sparse_topk64", tolerance=0.01),
}  # fmt: skip


def _encode(tokenizer, doc: dict) -> tuple[list[int], int]:
    """Token ids of `context + " " + target` and the number of target tokens (lm-eval's split)."""
    context = tokenizer(doc["context"], add_special_tokens=False).input_ids
    whole = tokenizer(doc["context"] + " " + doc["target"], add_special_tokens=False).input_ids
    return whole, len(whole) - len(context)


@torch.inference_mode()
def _logits(model, ids: torch.Tensor, stepwise: bool) -> torch.Tensor:
    if not stepwise:
        return model(ids, use_cache=False).logits
    from modeling_kdsa.cache import KDSACache

    cache = KDSACache(model.config)
    steps = [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])]
    return torch.cat(steps, dim=1)


def target_hits(model, tokenizer, docs: list[dict], stepwise: bool = False) -> list[list[bool]]:
    """Per doc, per target token: is it the greedy (argmax) prediction given the context and the target tokens before
    it? Up to a doc's first miss this is what greedy decoding generates. Docs of one task have equal lengths, so
    batches need no padding (grouped by length all the same, in case a task mixes lengths)."""
    encoded = [_encode(tokenizer, doc) for doc in docs]
    hits: list[list[bool]] = [[] for _ in docs]
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, (ids, n_target) in enumerate(encoded):
        by_shape.setdefault((len(ids), n_target), []).append(i)
    for (_, n_target), members in by_shape.items():
        for start in range(0, len(members), BATCH_SIZE):
            batch = members[start : start + BATCH_SIZE]
            ids = torch.tensor([encoded[i][0] for i in batch])
            predicted = _logits(model, ids[:, :-1], stepwise)[:, -n_target:].argmax(-1)
            for i, row in zip(batch, (predicted == ids[:, -n_target:]).tolist(), strict=True):
                hits[i] = row
    return hits


def doc_correct(model, tokenizer, docs: list[dict], stepwise: bool = False) -> list[bool]:
    """Per doc: is the whole target the greedy continuation (lm-eval's `acc` of our tasks)?"""
    return [all(row) for row in target_hits(model, tokenizer, docs, stepwise)]


def partial_credit(hits: list[list[bool]]) -> dict[str, float]:
    """For multi-token targets (copy), where exact match can hide how close a model gets: the fraction of target
    tokens predicted right, and the mean number of target tokens greedy decoding gets right before its first miss."""
    prefixes = [row.index(False) if False in row else len(row) for row in hits]
    return {"token_accuracy": sum(map(sum, hits)) / sum(map(len, hits)),
            "mean_correct_prefix": sum(prefixes) / len(prefixes), "target_tokens": len(hits[0])}  # fmt: skip


def exact_match(hits_by_task: dict[str, list[list[bool]]]) -> dict[str, float]:
    """Per task, the fraction of docs whose whole target is right."""
    return {task: sum(map(all, hits)) / len(hits) for task, hits in hits_by_task.items()}


def evaluate_hits(model, tokenizer, docs_by_task: dict[str, list[dict]], stepwise: bool = False) -> dict[str, list]:
    return {task: target_hits(model, tokenizer, docs, stepwise) for task, docs in docs_by_task.items()}


def evaluate(model, tokenizer, docs_by_task: dict[str, list[dict]], stepwise: bool = False) -> dict[str, float]:
    return exact_match(evaluate_hits(model, tokenizer, docs_by_task, stepwise))


def check(results: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Deltas to each configuration's reference and whether they are within tolerance."""
    report = {}
    for name, accuracy in results.items():
        configuration = CONFIGURATIONS[name]
        entry = {"description": configuration.description, "stepwise": configuration.stepwise,
                 "reference": configuration.reference, "tolerance": configuration.tolerance,
                 "accuracy": accuracy, "delta": None, "ok": True}  # fmt: skip
        if configuration.reference is not None and configuration.reference in results:
            delta = {task: accuracy[task] - results[configuration.reference][task] for task in accuracy}
            entry["delta"] = delta
            if configuration.tolerance is not None:
                entry["ok"] = all(d >= -configuration.tolerance - 1e-12 for d in delta.values())
        report[name] = entry
    return report


def format_table(results: dict[str, dict[str, float]], reference: str | None = None) -> str:
    """Tasks as rows; per configuration its accuracy and, when it has a reference among `results`, the delta."""
    report = check(results)
    header = ["task", "chance"]
    for name, entry in report.items():
        header.append(name)
        if entry["delta"] is not None:
            header.append(f"Δ vs {entry['reference']}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    tasks = next(iter(results.values())).keys()
    for task in tasks:
        row = [task, TASKS[task].chance]
        for entry in report.values():
            row.append(f"{entry['accuracy'][task]:.3f}")
            if entry["delta"] is not None:
                row.append(f"{entry['delta'][task]:+.3f}")
        lines.append("| " + " | ".join(row) + " |")
    tolerances = [f"{name}: drop ≤ {e['tolerance']:.2f} vs {e['reference']} → {'ok' if e['ok'] else 'EXCEEDED'}"
                  for name, e in report.items() if e["tolerance"] is not None and e["delta"] is not None]  # fmt: skip
    return "\n".join(lines + ([""] + tolerances if tolerances else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGURATIONS), choices=list(CONFIGURATIONS))
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--limit", type=int, default=None, help="first N docs per task")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=Path, default=Path("runs/accuracy.json"))
    # One thread by default: on a shared 2-core machine two OpenMP threads waiting for each other made one prefill
    # of 6 x 195 tokens take 40 s instead of 0.3 s (measured). Raise it on a quiet many-core machine.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_kdsa  # noqa: F401  (registers the architecture: the shipped checkpoints carry no code)

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    docs = {task: load_docs(task)[: args.limit] for task in args.tasks}
    # A configuration's reference runs too, even if not asked for, so that its delta can be checked.
    names = list(dict.fromkeys(n for name in args.configs for n in (CONFIGURATIONS[name].reference, name) if n))
    results, copy_partial = {}, None
    for name in tqdm(names, desc="configurations"):
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype)).eval()
        model = CONFIGURATIONS[name].prepare(model)
        hits = evaluate_hits(model, tokenizer, docs, stepwise=CONFIGURATIONS[name].stepwise)
        results[name] = exact_match(hits)
        if name == names[0] and "copy" in hits:  # partial credit of the reference configuration, for the README
            copy_partial = partial_credit(hits["copy"])
    report = check(results)
    print(f"checkpoint: {args.checkpoint}; {len(next(iter(docs.values())))} docs per task; dtype {args.dtype}\n")
    print(format_table(results))
    if "copy" in docs:
        print(f"\ncopy ({names[0]}): {copy_partial['token_accuracy']:.3f} of the target tokens right (teacher-forced); "
              f"greedy gets {copy_partial['mean_correct_prefix']:.1f} of {copy_partial['target_tokens']} right before "
              "its first miss, on average")  # fmt: skip
    passed = all(entry["ok"] for entry in report.values())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"checkpoint": args.checkpoint, "dtype": args.dtype, "docs_per_task":
                                     {t: len(d) for t, d in docs.items()}, "configurations": report,
                                     "copy_partial_credit": copy_partial,
                                     "passed": passed}, indent=2) + "\n")  # fmt: skip
    print(f"\n{'PASSED' if passed else 'FAILED'}: all deltas within tolerance" if passed else "\nFAILED: a delta "
          "exceeds its tolerance")  # fmt: skip
    print(f"JSON: {args.json}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
