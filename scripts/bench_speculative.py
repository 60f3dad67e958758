"""Speculative decoding benchmark: plain greedy vs prompt lookup vs an assistant (draft) model vs the checkpoint's
MTP layer vs a DSpark draft, all through `generate()` (docs/speculative.md; the rollback is `KDSACache.crop`,
modeling_kdsa/cache.py).

For each eval task's prompts (eval/tasks/data/<task>_test.jsonl: `copy` is copy-heavy, `recall_*` recall-heavy) and
each method, batch 1, greedy, a fixed number of new tokens (no early stop), after one warm-up call per method, the
methods taking turns prompt by prompt over `--repeats` passes (a slow spell of the machine hits them alike):
  - tokens/s (new tokens / wall time of `generate`) and the speed-up over plain greedy;
  - whether the output is token for token plain greedy's (it must be);
  - τ = new tokens per target forward (the prefill included), acceptance rate = accepted draft tokens / drafted
    tokens (from the target's forward calls: each verification forward sees the drafted tokens plus one);
  - peak memory of the KDA rollback records (checkpoints + per-token replay inputs) during generation, and the bytes
    one pending token adds;
  - for MTP and DSpark, the rounds that did not draft: `mtp` / `dspark` run generate()'s default adaptive schedule
    (a round drafts while drafting pays), `mtp_always` / `dspark_always` draft every round (docs/speculative.md §2a);
    `mtp_lookup` / `dspark_lookup` are the lookup-first hybrids (`prompt_lookup_num_tokens` next to the drafter,
    docs/speculative.md §2b), with the lookup rounds counted.

Models: the shipped tiny checkpoint (`checkpoints/kdsa-tiny`, with its MTP layer: `use_mtp=True`), its small draft
model (`checkpoints/kdsa-tiny-draft`, trained by `scripts/train_tiny.py --model draft`) and its DSpark draft
(`checkpoints/kdsa-tiny-dspark`, trained by `scripts/train_dspark.py`).

Task `repetitive` (not an eval task): the copy sources repeated three times, the best case for prompt lookup.
Task `free` (not an eval task): the first 12 words of each recall prompt, continued freely: no answer to find in
the prompt.

The verify-cost curve (one target forward over n = 1, 2, 4, 8, 16 tokens from a long cache on the bench shape, the
ceiling of any drafter) and the replay share of a round are `scripts/bench_verify_cost.py`'s; `--verify-cost` runs
it after the table with its own defaults.

Usage:  .venv/bin/python scripts/bench_speculative.py [--quick] [--tasks copy recall_mid repetitive] [--threads 1]
        [--prompts 4] [--repeats 2]
        [--methods plain prompt_lookup assisted mtp dspark mtp_always dspark_always mtp_lookup dspark_lookup]
        [--verify-cost] [--out PATH]
Writes JSON (default runs/bench_speculative.json) and prints a table.
"""

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from modeling_kdsa.eval import synthetic  # noqa: E402
from modeling_kdsa.eval.make_data import load_docs  # noqa: E402

from modeling_kdsa import KDSAForCausalLM  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from bench_verify_cost import cpu_name  # noqa: E402  (the CPU's model name, one helper for the benches' records)

CHECKPOINT = REPO_ROOT / "checkpoints" / "kdsa-tiny"
DRAFT = REPO_ROOT / "checkpoints" / "kdsa-tiny-draft"
DSPARK = REPO_ROOT / "checkpoints" / "kdsa-tiny-dspark"
METHODS = ("plain", "prompt_lookup", "assisted", "mtp", "dspark", "mtp_always", "dspark_always", "mtp_lookup",
           "dspark_lookup")  # fmt: skip
# The copy target is the whole source; recall answers are one word, so generate on past them.
NEW_TOKENS = {"copy": synthetic.EVAL_COPY_LENGTH, "repetitive": synthetic.EVAL_COPY_LENGTH}
FREE_PROMPT_WORDS = 12
DEFAULT_NEW_TOKENS = 48


def repetitive_docs(count: int) -> list[dict]:
    """Not an eval task: each copy test doc's source repeated three times. A model that continues the cycle
    (what greedy decoding of a random-weight model often does) is the best case for prompt lookup."""
    docs = []
    for doc in load_docs("copy")[:count]:
        source = doc["target"]
        docs.append({"context": " ".join(["copy", source, "|", source, "|", source])})
    return docs


def free_docs(count: int) -> list[dict]:
    """Not an eval task: the opening words of recall prompts, continued freely."""
    docs = load_docs("recall_mid")[:count]
    return [{"context": " ".join(doc["context"].split()[:FREE_PROMPT_WORDS])} for doc in docs]


def load_models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modeling_kdsa import DSparkDraftModel

    target = AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    dspark = DSparkDraftModel.from_pretrained(DSPARK, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(CHECKPOINT)
    source = "checkpoints/kdsa-tiny (+ its MTP layer) + checkpoints/kdsa-tiny-draft + checkpoints/kdsa-tiny-dspark"
    return target, {"assisted": draft, "dspark": dspark}, tokenizer, source


class VerifyCounter:
    """Watches the target's forward calls during one `generate`: how many tokens each verification drafted, and
    the peak size of the KDA rollback records."""

    def __init__(self, model: KDSAForCausalLM):
        self.handles = [
            model.register_forward_pre_hook(self.before, with_kwargs=True),
            model.register_forward_hook(self.after, with_kwargs=True),
        ]
        self.reset(0)

    def reset(self, prompt_len: int) -> None:
        self.prompt_len, self.rounds, self.drafted, self.peak_rollback, self.per_token = prompt_len, 0, 0, 0, 0

    def before(self, module, args, kwargs) -> None:
        new_tokens = kwargs["input_ids"].shape[1]
        cache = kwargs.get("cache")
        cached = cache.get_seq_length() if cache is not None else 0
        # The first call holds the prompt; every later one the last accepted token: the rest is the draft.
        uncached_known = self.prompt_len if cached == 0 else 1
        self.drafted += new_tokens - uncached_known
        self.rounds += 1

    def after(self, module, args, kwargs, output) -> None:
        if output.cache is not None:
            usage = output.cache.memory_bytes()
            self.peak_rollback = max(self.peak_rollback, usage["kda_rollback"])
            self.per_token = max(self.per_token, usage["rollback_per_token"])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def method_kwargs(method: str, drafts: dict, lookup_tokens: int) -> dict:
    if method == "prompt_lookup":
        return {"prompt_lookup_num_tokens": lookup_tokens}
    if method == "assisted":
        return {"assistant_model": drafts["assisted"]}
    # "mtp" / "dspark": generate()'s default draft schedule (adaptive: a round drafts while drafting pays, measured as
    # decoding goes); "*_always": every round drafts (docs/speculative.md §2a).
    schedule = {"draft_schedule": "always"} if method.endswith("_always") else {}
    if method.endswith("_lookup"):  # the lookup-first hybrid (docs/speculative.md §2b)
        schedule = {"prompt_lookup_num_tokens": lookup_tokens}
    if method.startswith("mtp"):
        return {"use_mtp": True, **schedule}
    if method.startswith("dspark"):
        return {"assistant_model": drafts["dspark"], "speculation_type": "dspark", **schedule}
    return {}


@torch.inference_mode()
def bench_task(target, drafts, tokenizer, task, prompts, new_tokens, lookup_tokens, counter, progress,
               methods=METHODS, repeats=1) -> list[dict]:  # fmt: skip
    """One row per method. The methods take turns prompt by prompt (in a rotating order, `repeats` times over the
    prompts), so that a slow spell of a shared machine falls on every method alike; a warm-up call per method first."""
    greedy = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    encoded = [tokenizer(doc["context"], return_tensors="pt").input_ids for doc in prompts]
    extras = {method: method_kwargs(method, drafts, lookup_tokens) for method in methods}
    for method in methods:
        target.generate(encoded[0], **greedy, **extras[method])  # warm-up
    plain_outputs = [target.generate(ids, **greedy) for ids in encoded]
    totals = {method: dict(seconds=0.0, identical=True, rounds=0, drafted=0, peak=0, per_token=0, undrafted=0,
                           lookup=0) for method in methods}  # fmt: skip
    turn = 0
    for _ in range(repeats):
        for i, ids in enumerate(encoded):
            order = methods[turn % len(methods) :] + methods[: turn % len(methods)]
            turn += 1
            for method in order:
                total = totals[method]
                counter.reset(ids.shape[1])
                start = time.perf_counter()
                out = target.generate(ids, **greedy, **extras[method])
                total["seconds"] += time.perf_counter() - start
                total["identical"] &= torch.equal(out, plain_outputs[i])
                total["rounds"] += counter.rounds
                total["drafted"] += counter.drafted
                if method.startswith(("mtp", "dspark")):  # KDSA's loop: rounds that chose not to draft
                    total["undrafted"] += target.speculation_stats.plain_rounds
                    total["lookup"] += target.speculation_stats.lookup_rounds
                total["peak"] = max(total["peak"], counter.peak_rollback)
                total["per_token"] = max(total["per_token"], counter.per_token)
                progress.update(1)
    rows = []
    generated = new_tokens * len(encoded) * repeats
    for method in methods:
        total = totals[method]
        accepted = generated - total["rounds"]  # each round yields its accepted draft tokens plus one of its own
        rows.append({
            "task": task, "method": method, "prompts": len(encoded), "repeats": repeats, "new_tokens": new_tokens,
            "tokens_per_s": generated / total["seconds"], "identical_to_plain": total["identical"],
            "verify_rounds": total["rounds"], "tokens_per_round": generated / total["rounds"],
            "drafted": total["drafted"], "undrafted_rounds": total["undrafted"], "lookup_rounds": total["lookup"],
            "acceptance_rate": accepted / total["drafted"] if total["drafted"] else None,
            "peak_rollback_bytes": total["peak"], "rollback_bytes_per_pending_token": total["per_token"],
        })  # fmt: skip
    plain_speed = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / plain_speed
    return rows


def format_table(rows: list[dict], source: str) -> str:
    lines = [
        f"models: {source}",
        "| task | method | tok/s | speed-up | = plain | target forwards | undrafted | lookup | τ (tok/forward) "
        "| accepted | rollback KiB | B/pending tok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acceptance = "—" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        lines.append(
            f"| {r['task']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{'yes' if r['identical_to_plain'] else 'NO'} | {r['verify_rounds']} | {r['undrafted_rounds']} | "
            f"{r['lookup_rounds']} | "
            f"{r['tokens_per_round']:.2f} | "
            f"{acceptance} | {r['peak_rollback_bytes'] / 1024:.1f} | {r['rollback_bytes_per_pending_token']} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["copy", "recall_mid", "free", "repetitive"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="plain is always run first (the reference)")  # fmt: skip
    parser.add_argument("--verify-cost", action="store_true",
                        help="then run scripts/bench_verify_cost.py (the verify-cost curve and the replay share)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per task (the first N test docs)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (methods take turns)")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 by default: the tiny models are overhead-bound, and on a shared "
                             "machine OpenMP threads contending with other jobs slow them down many times")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1 prompt per task, 16 new tokens (smoke test)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "bench_speculative.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num_prompts = 1 if args.quick else args.prompts

    target, drafts, tokenizer, source = load_models()
    methods = ["plain"] + [m for m in args.methods if m != "plain"]
    counter = VerifyCounter(target)
    rows = []
    repeats = 1 if args.quick else args.repeats
    total = len(args.tasks) * len(methods) * num_prompts * repeats
    with tqdm(total=total, desc="generate", dynamic_ncols=True) as progress:
        for task in args.tasks:
            new_tokens = 16 if args.quick else NEW_TOKENS.get(task, DEFAULT_NEW_TOKENS)
            if task == "repetitive":
                prompts = repetitive_docs(num_prompts)
            elif task == "free":
                prompts = free_docs(num_prompts)
            else:
                prompts = load_docs(task)[:num_prompts]
            rows += bench_task(target, drafts, tokenizer, task, prompts, new_tokens, args.lookup_tokens, counter,
                               progress, methods, repeats)  # fmt: skip
    counter.remove()

    table = format_table(rows, source)
    print(table)
    result = {
        "models": source, "target_parameters": sum(p.numel() for p in target.parameters()),
        "draft_parameters": sum(p.numel() for p in drafts["assisted"].parameters()),
        "dspark_parameters": sum(p.numel() for p in drafts["dspark"].parameters()),
        "mtp_parameters": sum(p.numel() for p in target.mtp.parameters()) if target.mtp is not None else 0,
        "lookup_tokens": args.lookup_tokens,
        "assistant": {"num_assistant_tokens": drafts["assisted"].generation_config.num_assistant_tokens,
                      "schedule": drafts["assisted"].generation_config.num_assistant_tokens_schedule},
        "dspark": {"block_size": drafts["dspark"].config.block_size,
                   "confidence_threshold": target.generation_config.assistant_confidence_threshold},
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
        "cpu_model": cpu_name(), "date": datetime.date.today().isoformat(),
        "command": " ".join(["scripts/bench_speculative.py"] + sys.argv[1:]),
        "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.verify_cost:
        import subprocess

        command = [sys.executable, str(REPO_ROOT / "scripts" / "bench_verify_cost.py"), "--threads", str(args.threads)]
        subprocess.run(command + (["--quick"] if args.quick else []), check=True)


if __name__ == "__main__":
    main()
