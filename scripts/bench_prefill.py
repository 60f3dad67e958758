"""Whole-model prefill of the benchmark shape: tokens/s and where the time goes.

One prefill of `--tokens` random tokens into a fresh `KDSACache` (KDSAConfig defaults, bf16, batch 1, logits of the
last token only), after a short warm-up prefill. Reports wall and CPU seconds (CPU time moves less than wall time when
other processes share the cores) and the seconds spent in each kind of module (KDA, DSA, MoE, dense MLP) and in the
KDA kernels (timers around the calls, nested: a KDA layer includes its kernels). `--profile` adds torch.profiler's
top operators by self CPU time (a second prefill, under the profiler).

`--package PATH` times another checkout's `modeling_kdsa` (e.g. the main branch), so that two versions can be
compared back to back on the same machine state:

    .venv/bin/python scripts/bench_prefill.py --tokens 4096 --threads 1 --package /path/to/other/checkout
    .venv/bin/python scripts/bench_prefill.py --tokens 4096 --threads 1

Writes JSON (default runs/bench_prefill.json) and prints a summary.
"""

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--package", type=Path, default=REPO_ROOT, help="checkout whose modeling_kdsa is timed")
    parser.add_argument("--profile", action="store_true", help="also torch.profiler's top operators")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "bench_prefill.json")
    return parser.parse_args(argv)


def add_timers(totals: collections.Counter) -> None:
    """Wrap the module forwards and the KDA kernels (as `kda.py` calls them) with timers adding to `totals`."""
    from modeling_kdsa import dsa, kda, moe

    def timed(function, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            totals[key] += time.perf_counter() - start
            return result

        return wrapper

    for name in ("chunk_kda", "causal_short_conv", "l2norm", "kda_gate"):
        if hasattr(kda, name):
            setattr(kda, name, timed(getattr(kda, name), f"kernel {name}"))
    if hasattr(kda, "kernel_set"):  # the chunked kernel looked up through a kernel registry
        lookup = kda.kernel_set

        def kernel_set(*args, **kwargs):
            kernels = lookup(*args, **kwargs)
            if kernels.kda_chunk is None:
                return kernels
            return dataclasses.replace(kernels, kda_chunk=timed(kernels.kda_chunk, "kernel chunk_kda"))

        kda.kernel_set = kernel_set
    layers = {"KDA layers": kda.KDSAKimiDeltaAttention, "DSA layers": dsa.KDSASparseAttention, "MoE": moe.KDSAMoE}
    layers["dense MLP and shared experts"] = moe.KDSAMLP
    for key, cls in layers.items():
        cls.forward = timed(cls.forward, key)


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(args.package.resolve()))
    import torch

    import modeling_kdsa
    from modeling_kdsa import KDSAConfig, KDSAForCausalLM
    from modeling_kdsa.cache import KDSACache

    if args.threads:
        torch.set_num_threads(args.threads)
    totals = collections.Counter()
    add_timers(totals)
    config = KDSAConfig(max_position_embeddings=1 << 17)
    torch.manual_seed(0)
    model = KDSAForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(2))

    def prefill():
        return model(input_ids=ids, cache=KDSACache(config), use_cache=True, logits_to_keep=1)

    with torch.inference_mode():
        model(input_ids=ids[:, :256], cache=KDSACache(config), use_cache=True, logits_to_keep=1)  # warm-up
        totals.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        prefill()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        report = dict(
            package=str(Path(modeling_kdsa.__file__).parent.parent),
            tokens=args.tokens,
            threads=torch.get_num_threads(),
            load_average=os.getloadavg(),
            wall_s=wall,
            cpu_s=cpu,
            tokens_per_s_wall=args.tokens / wall,
            tokens_per_s_cpu=args.tokens / cpu,
            module_wall_s=dict(totals.most_common()),
        )
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                prefill()
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            report["top_ops"] = [
                dict(name=e.key, self_cpu_s=e.self_cpu_time_total / 1e6, calls=e.count) for e in events[:15]
            ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"{report['package']}: prefill {args.tokens} tokens, wall {wall:.2f} s ({report['tokens_per_s_wall']:.0f} "
        f"tokens/s), CPU {cpu:.2f} s ({report['tokens_per_s_cpu']:.0f} tokens/s), load {report['load_average'][0]:.2f}"
    )
    for key, seconds in report["module_wall_s"].items():
        print(f"  {key:30s} {seconds:7.2f} s  {seconds / wall:5.1%}")
    for op in report.get("top_ops", []):
        print(f"  {op['name']:40s} {op['self_cpu_s']:7.2f} s self CPU  x{op['calls']}")
    return report


if __name__ == "__main__":
    main()
