"""Microbenchmark of the paged DSA kernels (modeling_kdsa/dsa_paged_*.py): reference vs fused vs compiled.

What it measures, in one run, with the default KDSAConfig dims (H 16, C 256, R 32, HI 8, DI 64, index_topk 512,
pages of 64 tokens), bf16, batch 1, `torch.inference_mode()`, median of `--repeats` timed calls after warm-up:
  1. decode (T = 1) at contexts 4k, 16k, 64k and one prefill query block (T = 128) at 16k: indexer top-k and
     sparse attention, separately and together, and dense MLA over the whole context (a Kimi-Linear full-attention
     layer's kernel), for the backends `torch` (gather pages + dsa_ops reference), `cpu` (fused) and `compiled`
     (fused with torch.compile), plus the fused/compiled top-k recall against the reference's selection (bf16
     products make a few near-equal keys swap) and the dense output's largest difference from the reference's;
  2. compile time cold and warm: two fresh subprocesses compile the decode and prefill graphs against one new,
     empty inductor cache directory; the second must hit inductor's on-disk FX graph cache.

The pages are random and placed through a shuffled block table, as a paged cache holding several sequences would
hold them; the `decode-seq` case places them at consecutive page ids instead, as the cache hands them to a single
sequence (the fused indexer then reads them in place, docs/dsa.md §7).

Usage:  .venv/bin/python scripts/bench_dsa_kernels.py [--quick] [--repeats N] [--out PATH]
Writes JSON (default runs/bench_dsa_kernels.json) and prints a table.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from modeling_kdsa import KDSAConfig  # noqa: E402
from modeling_kdsa.dsa import mla_softmax_scale  # noqa: E402
from modeling_kdsa.dsa_paged_common import PagedKeys  # noqa: E402
from modeling_kdsa.kernels import COMPILED_KERNELS, CPU_KERNELS, TORCH_KERNELS  # noqa: E402

DTYPE = torch.bfloat16
PAGE_SIZE = 64
FULL_CASES = [
    ("decode", 4096, 1),
    ("decode", 16384, 1),
    ("decode", 65536, 1),
    ("decode-seq", 65536, 1),
    ("prefill", 16384, 128),
]
QUICK_CASES = [("decode", 512, 1), ("decode", 2048, 1), ("decode-seq", 2048, 1), ("prefill", 2048, 32)]


def case_inputs(config: KDSAConfig, num_keys: int, num_queries: int, seed: int = 0, consecutive: bool = False) -> dict:
    """Random queries and pages for the last `num_queries` positions of a `num_keys` context, pages shuffled (or at
    consecutive page ids)."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = -(-num_keys // PAGE_SIZE)
    heads, latent_dim, rope_dim = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    shuffled = torch.randperm(num_pages + 4, generator=generator)[:num_pages]
    block_table = (torch.arange(2, num_pages + 2) if consecutive else shuffled).view(1, num_pages)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DTYPE)

    return {
        "q_index": randn(1, num_queries, config.index_n_heads, config.index_head_dim),
        "weights": torch.randn(1, num_queries, config.index_n_heads, generator=generator),
        "index_pages": randn(num_pages + 4, PAGE_SIZE, config.index_head_dim),
        "kv_pages": randn(num_pages + 4, PAGE_SIZE, latent_dim + rope_dim),
        "block_table": block_table,
        "q_latent": randn(1, num_queries, heads, latent_dim),
        "q_pe": randn(1, num_queries, heads, rope_dim),
    }


def indexer_args(config: KDSAConfig, inputs: dict, num_keys: int, num_queries: int) -> tuple:
    """The paged indexer's arguments for `case_inputs`: its queries are the last `num_queries` of `num_keys`."""
    keys = PagedKeys(inputs["index_pages"], inputs["block_table"], num_keys, num_keys - num_queries)
    return inputs["q_index"], inputs["weights"], keys, config.index_topk


def median_ms(function, repeats: int) -> float:
    function()  # warm-up (and, for the compiled backend, the compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def recall(selected: torch.Tensor, expected: torch.Tensor) -> float:
    hits = sum(
        len(set(got.tolist()) & set(want.tolist()))
        for got, want in zip(selected.flatten(0, 1), expected.flatten(0, 1), strict=True)
    )
    return hits / expected.numel()


def bench_case(config, kind: str, num_keys: int, num_queries: int, repeats: int) -> list[dict]:
    inputs = case_inputs(config, num_keys, num_queries, consecutive=kind == "decode-seq")
    query_start = num_keys - num_queries
    scale = mla_softmax_scale(config)
    index_args = indexer_args(config, inputs, num_keys, num_queries)
    reference_indices = TORCH_KERNELS.indexer_topk(*index_args)
    kv_keys = PagedKeys(inputs["kv_pages"], inputs["block_table"], num_keys, query_start)
    dense_args = (inputs["q_latent"], inputs["q_pe"], kv_keys, scale)
    reference_dense = TORCH_KERNELS.dense_mla(*dense_args).float()
    rows = []
    for kernels in (TORCH_KERNELS, CPU_KERNELS, COMPILED_KERNELS):
        backend, indexer, sparse_mla = kernels.name, kernels.indexer_topk, kernels.sparse_mla
        indices = indexer(*index_args)
        attention_args = (inputs["q_latent"], inputs["q_pe"], kv_keys, indices, scale)
        indexer_ms = median_ms(lambda indexer=indexer: indexer(*index_args), repeats)
        attention_ms = median_ms(lambda sparse_mla=sparse_mla, args=attention_args: sparse_mla(*args), repeats)

        def both(indexer=indexer, sparse_mla=sparse_mla):
            selected = indexer(*index_args)
            sparse_mla(inputs["q_latent"], inputs["q_pe"], kv_keys, selected, scale)

        rows.append(
            {
                "case": kind,
                "context": num_keys,
                "queries": num_queries,
                "backend": backend,
                "indexer_ms": indexer_ms,
                "attention_ms": attention_ms,
                "total_ms": median_ms(both, repeats),
                "recall_vs_reference": recall(indices, reference_indices),
                "dense_ms": median_ms(lambda dense=kernels.dense_mla: dense(*dense_args), repeats),
                "dense_max_abs_diff_vs_reference": (kernels.dense_mla(*dense_args).float() - reference_dense)
                .abs()
                .max()
                .item(),
            }
        )
    return rows


def compile_probe(quick: bool) -> None:
    """Run in a fresh subprocess: compile the decode and prefill graphs once, print one JSON line."""
    from torch._dynamo.utils import counters

    config = KDSAConfig()
    scale = mla_softmax_scale(config)
    indexer, sparse_mla = COMPILED_KERNELS.indexer_topk, COMPILED_KERNELS.sparse_mla
    start = time.perf_counter()
    with torch.inference_mode():
        for _, num_keys, num_queries in QUICK_CASES if quick else FULL_CASES[:1] + FULL_CASES[-1:]:
            inputs = case_inputs(config, num_keys, num_queries)
            indices = indexer(*indexer_args(config, inputs, num_keys, num_queries))
            kv_keys = PagedKeys(inputs["kv_pages"], inputs["block_table"])
            sparse_mla(inputs["q_latent"], inputs["q_pe"], kv_keys, indices, scale)
    result = {
        "seconds": time.perf_counter() - start,
        "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
        "fx_graph_cache_misses": counters["inductor"]["fxgraph_cache_miss"],
        "aot_autograd_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_autograd_cache_misses": counters["aot_autograd"]["autograd_cache_miss"],
    }
    print(json.dumps(result))


def compile_times(quick: bool) -> dict:
    """Cold and warm compile in two fresh processes sharing one new, empty TORCHINDUCTOR_CACHE_DIR."""
    with tempfile.TemporaryDirectory(prefix="kdsa_inductor_") as cache_dir:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
        command = [sys.executable, __file__, "--compile-probe"] + (["--quick"] if quick else [])
        runs = {}
        for name in ("cold", "warm"):
            start = time.perf_counter()
            result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            runs[name] = json.loads(result.stdout.strip().splitlines()[-1])
            runs[name]["process_seconds"] = time.perf_counter() - start
    return runs


def print_table(rows: list[dict], compile_runs: dict) -> None:
    header = f"{'case':<11}{'context':>8}{'T':>5}  {'backend':<9}{'indexer ms':>11}{'attn ms':>9}{'total ms':>10}"
    header += f"{'recall':>8}{'dense ms':>10}{'dense diff':>12}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['case']:<11}{row['context']:>8}{row['queries']:>5}  {row['backend']:<9}{row['indexer_ms']:>11.2f}"
            f"{row['attention_ms']:>9.2f}{row['total_ms']:>10.2f}{row['recall_vs_reference']:>8.4f}"
            f"{row['dense_ms']:>10.2f}{row['dense_max_abs_diff_vs_reference']:>12.1e}"
        )
    print()
    for name, run in compile_runs.items():
        print(
            f"compile {name}: {run['seconds']:.1f} s in-process ({run['process_seconds']:.1f} s with start-up), "
            f"FX graph cache hits/misses {run['fx_graph_cache_hits']}/{run['fx_graph_cache_misses']}, "
            f"AOTAutograd cache hits/misses {run['aot_autograd_cache_hits']}/{run['aot_autograd_cache_misses']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small contexts (smoke run, about a minute)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 10, quick 3)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "bench_dsa_kernels.json")
    parser.add_argument("--compile-probe", action="store_true", help=argparse.SUPPRESS)  # used by compile_times()
    args = parser.parse_args()
    if args.compile_probe:
        compile_probe(args.quick)
        return

    config = KDSAConfig()
    repeats = args.repeats or (3 if args.quick else 10)
    cases = QUICK_CASES if args.quick else FULL_CASES
    rows = []
    with torch.inference_mode():
        for kind, num_keys, num_queries in tqdm(cases, desc="kernels", unit="case", file=sys.stderr):
            rows.extend(bench_case(config, kind, num_keys, num_queries, repeats))
    with tqdm(total=2, desc="compile cold/warm", unit="process", file=sys.stderr) as progress:
        compile_runs = compile_times(args.quick)
        progress.update(2)
    print_table(rows, compile_runs)

    report = {
        "dims": {
            "heads": config.num_attention_heads,
            "kv_lora_rank": config.kv_lora_rank,
            "qk_rope_head_dim": config.qk_rope_head_dim,
            "index_n_heads": config.index_n_heads,
            "index_head_dim": config.index_head_dim,
            "index_topk": config.index_topk,
            "page_size": PAGE_SIZE,
            "dtype": str(DTYPE),
        },
        "machine": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "load_average_at_end": os.getloadavg(),
        },
        "repeats": repeats,
        "results": rows,
        "compile": compile_runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
