"""Verify-cost benchmark: one forward over n = 1, 2, 4, 8, 16 new tokens from a filled cache, and the replay (KDA
rollback) that follows a verification (docs/kda.md §7, docs/graph-mode.md §13).

The bench shape of scripts/bench_graph_mode.py (KDSAConfig defaults, bf16, batch 1, eager paged `KDSACache`), with
rollback records on (`KDSACache(config, rollback_tokens=256)`, as speculative decoding runs it). At each context C
(default 4096 and 65536) the cache is filled with random rows / states through the layers' own writes
(bench_graph_mode.fill), then:
  1. verify: one forward over n new tokens (logits for all n, as a verification needs them), timed; the cache is
     cropped back to C outside the timed region. The n values alternate within each repeat, so all see the same
     machine state; the ratio to n = 1 is taken per repeat (median reported) and from the medians;
  2. replay: a round of a forward over n tokens, then `cache.crop` to keep n // 2 of them (the KDA layers replay the
     kept tokens from their checkpoint, the DSA pages are truncated), each timed; the replay share of the round is
     crop / (forward + crop). The context grows by n // 2 per round (a few tokens over C).

Usage:  .venv/bin/python scripts/bench_verify_cost.py [--quick] [--contexts 4096 65536] [--tokens 1 2 4 8 16]
        [--repeats 9] [--threads 1] [--out PATH]
Writes JSON (default runs/bench_verify_cost.json) and prints a table. `--quick`: the small model of
bench_graph_mode's smoke run, context 256, 2 repeats.
"""

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from modeling_kdsa.cache import KDAReplayLayer, KDSACache  # noqa: E402

ROLLBACK_TOKENS = 256


def sibling(name: str):
    """scripts/<name>.py as a module (its helpers are reused, not copied)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


graph_bench = sibling("bench_graph_mode")


def filled_cache(config, context: int) -> KDSACache:
    """A `KDSACache` with rollback records on, holding `context` random tokens (bench_graph_mode.fill). The KDA
    layers' own token count (their rollback checkpoint) is set to the context, as a prefill would leave it."""
    cache = graph_bench.fill(KDSACache(config, rollback_tokens=ROLLBACK_TOKENS), config, context)
    for layer in cache.layers:
        if isinstance(layer, KDAReplayLayer):
            layer.num_tokens = layer.checkpoint_tokens = context
    return cache


def forward(model, cache, n: int, generator: torch.Generator):
    """One forward over n random tokens from the cache, logits for all of them (a verification)."""
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=generator)
    return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=n).logits


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure_context(model, config, context: int, tokens: list[int], repeats: int, warmup: int) -> dict:
    cache = filled_cache(config, context)
    generator = torch.Generator().manual_seed(0)
    verify = {n: [] for n in tokens}
    for repeat in range(warmup + repeats):
        for n in tokens:
            elapsed = timed(lambda n=n: forward(model, cache, n, generator))
            cache.crop(context)
            if repeat >= warmup:
                verify[n].append(elapsed)
    base = tokens[0]
    rows = {}
    for n in tokens:
        per_repeat = [t / b for t, b in zip(verify[n], verify[base], strict=True)]
        rows[n] = dict(
            verify_median_s=statistics.median(verify[n]),
            verify_min_s=min(verify[n]),
            verify_times_s=verify[n],
            ratio_to_one=statistics.median(verify[n]) / statistics.median(verify[base]),
            ratio_per_repeat_median=statistics.median(per_repeat),
        )
    # Replay rounds: forward n, then crop to keep n // 2 (the context grows by that much per round).
    for repeat in range(warmup + repeats):
        for n in tokens:
            if n // 2 == 0:
                continue
            past = cache.get_seq_length()
            forward_s = timed(lambda n=n: forward(model, cache, n, generator))
            crop_s = timed(lambda n=n, past=past: cache.crop(past + n // 2))
            if repeat >= warmup:
                rows[n].setdefault("round_forward_s", []).append(forward_s)
                rows[n].setdefault("replay_s", []).append(crop_s)
    for n in tokens:
        if "replay_s" not in rows[n]:
            continue
        shares = [c / (f + c) for f, c in zip(rows[n]["round_forward_s"], rows[n]["replay_s"], strict=True)]
        rows[n].update(
            replay_median_s=statistics.median(rows[n]["replay_s"]),
            replay_share_median=statistics.median(shares),
            replayed_tokens=n // 2,
        )
    return dict(context=context, final_context=cache.get_seq_length(), rows={str(n): r for n, r in rows.items()})


def summary_rows(results: dict) -> list[dict]:
    """One row per context and n: the figures the table prints (and docs/benchmarks.md renders from the JSON)."""
    rows = []
    for context, entry in results.items():
        for n, row in entry["rows"].items():
            rows.append(dict(
                context=int(context), n=int(n), verify_ms=round(1e3 * row["verify_median_s"], 2),
                ratio_to_one=round(row["ratio_to_one"], 3), ratio_per_repeat=round(row["ratio_per_repeat_median"], 3),
                replay_ms=round(1e3 * row["replay_median_s"], 2) if "replay_median_s" in row else None,
                replay_share=round(row["replay_share_median"], 4) if "replay_share_median" in row else None,
            ))  # fmt: skip
    return rows


def print_table(report: dict) -> None:
    print(f"\nverify cost ({report['environment']['cpu']}, {report['environment']['threads']} thread(s), bf16)")
    print(f"{'context':>8} {'n':>3} {'verify ms':>10} {'x n=1':>7} {'x/rep':>7} {'replay ms':>10} {'replay %':>9}")
    for row in report["rows"]:
        replay = f"{row['replay_ms']:10.2f}" if row["replay_ms"] is not None else f"{'-':>10}"
        share = f"{100 * row['replay_share']:8.1f}%" if row["replay_share"] is not None else f"{'-':>9}"
        print(
            f"{row['context']:>8} {row['n']:>3} {row['verify_ms']:10.2f} {row['ratio_to_one']:7.2f} "
            f"{row['ratio_per_repeat']:7.2f} {replay} {share}"
        )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, context 256, 2 repeats (smoke run)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench_verify_cost.json"))
    args = parser.parse_args(argv)
    if args.contexts is None:
        args.contexts = [256] if args.quick else [4096, 65536]
    if args.repeats is None:
        args.repeats = 2 if args.quick else 9
    if args.quick:
        args.warmup = min(args.warmup, 1)
    if any(n < 1 or n > ROLLBACK_TOKENS for n in args.tokens) or args.tokens[0] != 1:
        parser.error(f"--tokens must start with 1 and lie in 1..{ROLLBACK_TOKENS}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        config = graph_bench.bench_config(args.quick)
        model = graph_bench.build_model(config)
        results = {}
        with torch.no_grad():
            for context in args.contexts:
                results[str(context)] = measure_context(model, config, context, args.tokens, args.repeats, args.warmup)
    finally:
        torch.set_num_threads(threads)
    report = dict(
        environment=dict(cpu=cpu_name(), threads=args.threads, torch=torch.__version__, quick=args.quick,
                         date=datetime.date.today().isoformat(),
                         command=" ".join(["scripts/bench_verify_cost.py"] + (sys.argv[1:] if argv is None else argv))),
        tokens=args.tokens,
        repeats=args.repeats,
        contexts=args.contexts,
        rows=summary_rows(results),
        results=results,  # per context: every repeat's times
    )
    print_table(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
