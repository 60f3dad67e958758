"""Microbenchmark of the C++ CPU kernels against the torch paths they replace, side by side in one run.

What it measures (bf16 activations, batch 1, `torch.inference_mode()`, `--threads` intra-op threads):
  1. `kda`: one KDA recurrence step (16 heads of 64 x 64, the benchmark shape) of six layers' fp32 states in turn:
     `kda_ops.recurrent_kda` against the cpu backend's kernel (docs/kda.md §9), with the states out of cache (a 64 MiB
     buffer written before each round) and in cache (the same six states again right after);
  2. `fp8`: the forward of one bf16 row through an FP8-held layer (`KDSAFP8Linear`, 128 x 128 blocks) for three
     weight shapes: torch's dequantization (`fp8_linear.dequantize_tiles_torch`) and the row product against the
     layer's forward (the fused kernel that dequantizes inside the row product, docs/checkpoint-conversion.md §9),
     and the same product with the bf16 weight for scale; each path timed on its second call in a row;
  3. `row`: one bf16 row times a weight out of cache (six copies of each shape in turn, the buffer written before
     each path) through the row kernel (`linear`) against `F.linear` (docs/graph-mode.md §10);
  4. `mla`: an absorbed MLA layer's two per-head products of a decode step (the query into the latent space, the
     latent output out of it) with `kv_b_proj.weight` out of cache (six layers' weights in turn, the buffer written
     before each path): contiguous copies of its two slices and the einsums, the layer's path without the kernels,
     against the head kernels reading the slices in place (docs/dsa.md §13);
  5. `experts`: a decode step's tokens through a MoE layer's routed experts (`KDSAExperts`, six layers' experts in
     turn, the buffer written before each path): eagerly, the loop over the experts (a host sync, then one row-kernel
     product pair per expert) against the expert kernel's two calls for all slots; compiled (inductor, the fixed-shape
     decode path), inductor's multiply-and-sum over the gathered weights (one per slot) against the kernel as one op
     (docs/graph-mode.md §12). One token at the benchmark's expert shape (8 experts of 1024 x 512, 2 per token) and at
     a wider one (16 experts of 2048 x 1024, 4 per token); four tokens (a batch of 4 sequences) at the benchmark's.
In each round the paths run one after the other, so that both see the same machine; the table gives the median and
minimum of each path and the median, min and max of the per-round ratio (torch path / kernel).

Usage:  .venv/bin/python scripts/bench_cpu_kernels.py [--quick] [--repeats N] [--threads N] [--out PATH]
Writes JSON (default runs/bench_cpu_kernels.json) and prints a table. Kernels that cannot run here (no AVX2,
no compiler) are reported as such.
"""

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from modeling_kdsa import (  # noqa: E402
    cpu_expert_linear,
    cpu_fp8_dequantize,
    cpu_head_products,
    cpu_kda_recurrent,
    cpu_row_linear,
)
from modeling_kdsa import kernels as kernels_module  # noqa: E402
from modeling_kdsa import moe as moe_module  # noqa: E402
from modeling_kdsa.configuration_kdsa import KDSAConfig  # noqa: E402
from modeling_kdsa.fp8_linear import KDSAFP8Linear  # noqa: E402
from modeling_kdsa.kda_ops import recurrent_kda  # noqa: E402
from modeling_kdsa.linear_ops import dequantize_tiles_torch  # noqa: E402

# The cpu backend's products: the C++ kernels where they apply.
linear = kernels_module.CPU_KERNELS.row_linear
per_head_matmul, per_head_linear = kernels_module.CPU_KERNELS.head_matmul, kernels_module.CPU_KERNELS.head_linear

DTYPE = torch.bfloat16
EVICT_BYTES = 64 << 20  # written between rounds: more than this machine's caches
FP8_SHAPES = [(1024, 1024), (4096, 1024), (1024, 2816)]
ROW_SHAPES = [(1024, 1024), (2816, 1024), (1024, 2816), (32000, 1024)]
QUICK_FP8_SHAPES = [(256, 256), (512, 384)]
QUICK_ROW_SHAPES = [(256, 256), (1024, 256)]
# (heads, Dn, Dv, C): the benchmark shape, and DeepSeek-V3.2's (128 heads, `kv_b_proj` 32 MiB a layer).
MLA_SHAPES = [(16, 128, 128, 512), (128, 128, 128, 512)]
QUICK_MLA_SHAPES = [(4, 32, 32, 64)]
# (experts, width D, intermediate I, experts per token, tokens)
EXPERT_SHAPES = [(8, 1024, 512, 2, 1), (16, 2048, 1024, 4, 1), (8, 1024, 512, 2, 4)]
QUICK_EXPERT_SHAPES = [(4, 64, 32, 2, 1), (4, 64, 32, 2, 2)]


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def summary(name: str, reference_s: list[float], kernel_s: list[float], **fields) -> dict:
    """Both paths' per-round times (seconds) as median / min in ms, and the per-round ratios reference / kernel with
    their median, min and max."""
    ratios = [r / k for r, k in zip(reference_s, kernel_s, strict=True)]
    return dict(
        name=name,
        **fields,
        reference_ms=statistics.median(reference_s) * 1e3,
        reference_min_ms=min(reference_s) * 1e3,
        kernel_ms=statistics.median(kernel_s) * 1e3,
        kernel_min_ms=min(kernel_s) * 1e3,
        ratios=ratios,
        ratio_median=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
    )


def bench_kda(repeats: int, evict: torch.Tensor) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    heads, dim = 16, 64
    q, k = (F.normalize(torch.randn(1, 1, heads, dim, generator=generator), dim=-1) for _ in range(2))
    v = torch.randn(1, 1, heads, dim, generator=generator).to(DTYPE)
    g = -torch.rand(1, 1, heads, dim, generator=generator)
    beta = torch.rand(1, 1, heads, generator=generator)
    states = [torch.randn(1, heads, dim, dim, generator=generator) * 0.1 for _ in range(6)]
    paths = dict(reference=recurrent_kda, kernel=cpu_kda_recurrent.cpu_recurrent_kda)
    times = {(path, temperature): [] for path in paths for temperature in ("cold", "warm")}
    for _ in range(repeats + 1):  # the first round warms up
        for path, function in paths.items():
            evict.add_(1)

            def step(function=function):
                for state in states:
                    function(q, k, v, g, beta, None, state, True)

            times[path, "cold"].append(timed(step) / len(states))
            times[path, "warm"].append(timed(step) / len(states))
    return [
        summary(
            f"kda step, {temperature}",
            times["reference", temperature][1:],
            times["kernel", temperature][1:],
            kernel="kda",
        )
        for temperature in ("cold", "warm")
    ]


def fp8_case(rows: int, cols: int, seed: int = 0):
    """A layer's weight as DeepSeek stores it: E4M3 values, one fp32 scale per 128 x 128 tile (amax / 448)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator) * 0.02
    grid = (-(-rows // 128), -(-cols // 128))
    padded = torch.zeros(grid[0] * 128, grid[1] * 128)
    padded[:rows, :cols] = weight
    tiles = padded.view(grid[0], 128, grid[1], 128)
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    values = (tiles / scale_inv[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return values.contiguous(), scale_inv


def bench_fp8(rows: int, cols: int, repeats: int) -> dict:
    values, scale_inv = fp8_case(rows, cols)
    layer = KDSAFP8Linear(values, scale_inv, (128, 128))
    bf16_weight = layer.dequantized_weight(DTYPE)
    x = torch.randn(1, 1, cols, generator=torch.Generator().manual_seed(1)).to(DTYPE)

    def torch_path():
        return linear(x, dequantize_tiles_torch(values, scale_inv, (128, 128), DTYPE))

    reference_s, kernel_s, bf16_s = [], [], []
    paths = (torch_path, lambda: layer(x), lambda: linear(x, bf16_weight))
    for round_index in range(repeats + 1):
        for record, path in zip((reference_s, kernel_s, bf16_s), paths, strict=True):
            # An untimed call first: the torch path's large temporaries leave the allocator handing the next
            # allocations fresh pages from the system, which a steady run of either path does not see.
            path()
            if round_index:  # the first round warms up
                record.append(timed(path))
    assert torch.equal(torch_path(), layer(x))  # the kernel's weights are the torch path's, bit for bit
    return summary(f"fp8-held forward {rows}x{cols}", reference_s, kernel_s, kernel="fp8",
                   bf16_product_ms=statistics.median(bf16_s) * 1e3)  # fmt: skip


def cold_rounds(reference, kernel, weights: list, repeats: int, evict: torch.Tensor) -> tuple[list, list]:
    """Per-round seconds of `reference(w)` and `kernel(w)` over every weight in turn, the buffer written before each
    path so that the weights come from memory; the first round warms up and is dropped."""
    reference_s, kernel_s = [], []
    for round_index in range(repeats + 1):
        evict.add_(1)
        reference_time = timed(lambda: [reference(w) for w in weights]) / len(weights)
        evict.add_(1)
        kernel_time = timed(lambda: [kernel(w) for w in weights]) / len(weights)
        if round_index:
            reference_s.append(reference_time)
            kernel_s.append(kernel_time)
    return reference_s, kernel_s


def streaming_summary(name: str, kernel_name: str, reference_s: list, kernel_s: list, weight_bytes: int) -> dict:
    """`summary` with the rate at which each path read the weights (GB/s, median)."""
    return summary(name, reference_s, kernel_s, kernel=kernel_name,
                   kernel_gbs=weight_bytes / statistics.median(kernel_s) / 1e9,
                   reference_gbs=weight_bytes / statistics.median(reference_s) / 1e9)  # fmt: skip


def bench_row(rows: int, cols: int, repeats: int, evict: torch.Tensor) -> dict:
    generator = torch.Generator().manual_seed(2)
    weights = [(torch.randn(rows, cols, generator=generator) * 0.02).to(DTYPE) for _ in range(6)]
    x = torch.randn(1, 1, cols, generator=generator).to(DTYPE)
    times = cold_rounds(lambda w: F.linear(x, w), lambda w: linear(x, w), weights, repeats, evict)
    return streaming_summary(f"row product {rows}x{cols}", "row", *times, weight_bytes=rows * cols * 2)


def bench_mla(heads: int, nope: int, value: int, latent: int, repeats: int, evict: torch.Tensor) -> dict:
    generator = torch.Generator().manual_seed(3)
    weights = [
        (torch.randn(heads * (nope + value), latent, generator=generator) * 0.02).to(DTYPE).view(heads, -1, latent)
        for _ in range(6)
    ]
    q = torch.randn(1, 1, heads, nope, generator=generator).to(DTYPE)
    out_latent = torch.randn(1, 1, heads, latent, generator=generator).to(DTYPE)

    def reference(weight):
        w_uk, w_uv = weight[:, :nope].contiguous(), weight[:, nope:].contiguous()
        return torch.einsum("bthn,hnk->bthk", q, w_uk), torch.einsum("bthk,hnk->bthn", out_latent, w_uv)

    def kernel(weight):
        return per_head_matmul(q, weight[:, :nope]), per_head_linear(out_latent, weight[:, nope:])

    times = cold_rounds(reference, kernel, weights, repeats, evict)
    name = f"mla head products {heads}x{nope + value}x{latent}"
    return streaming_summary(name, "mla", *times, weight_bytes=heads * (nope + value) * latent * 2)


def bench_experts(num_experts: int, width: int, intermediate: int, top_k: int, tokens: int, repeats: int,
                  evict: torch.Tensor) -> list[dict]:  # fmt: skip
    """Eager and compiled rows for `tokens` tokens through six layers' routed experts in turn."""
    config = KDSAConfig(hidden_size=width, moe_intermediate_size=intermediate, n_routed_experts=num_experts)
    generator = torch.Generator().manual_seed(4)
    layers = []
    for _ in range(6):
        experts = moe_module.KDSAExperts(config)
        for parameter in experts.parameters():
            parameter.data = (torch.randn(parameter.shape, generator=generator) * 0.02).to(DTYPE)
        layers.append(experts)
    hidden = torch.randn(tokens, width, generator=generator).to(DTYPE)
    indices = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    weight_bytes = indices.unique().numel() * 3 * width * intermediate * 2  # each chosen expert's weights, once
    name = f"experts {num_experts}x{width}x{intermediate} top{top_k}" + (f" x{tokens} tokens" if tokens > 1 else "")

    def never(*args):
        return False

    def without_kernel(function):
        """`function` with `KDSAExperts` deciding that the expert kernel does not apply (compiled: traced so)."""

        def call(*args):
            cpu_kernels = kernels_module.CPU_KERNELS
            kernels_module.CPU_KERNELS = dataclasses.replace(cpu_kernels, experts_in_place=never)
            try:
                return function(*args)
            finally:
                kernels_module.CPU_KERNELS = cpu_kernels

        return call

    def eager(experts):
        return experts(hidden, indices, weights)

    times = cold_rounds(without_kernel(eager), eager, layers, repeats, evict)
    results = [streaming_summary(f"{name}, eager", "experts", *times, weight_bytes=weight_bytes)]

    # One compiled function over the six layers' weights, passed as inputs; the patched decision is a global the
    # graph guards on, so each path keeps its own graph (checked below: two graphs, equal outputs).
    template = moe_module.KDSAExperts(config)  # holds none of the weights passed in (dynamo guards on identity)

    def routed(gate_up, down):
        parameters = {"gate_up_proj": gate_up, "down_proj": down}
        return torch.func.functional_call(template, parameters, (hidden, indices, weights))

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(routed, dynamic=False, fullgraph=True)
    stacked = [(experts.gate_up_proj, experts.down_proj) for experts in layers]
    times = cold_rounds(without_kernel(lambda w: compiled(*w)), lambda w: compiled(*w), stacked, repeats, evict)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    reference = without_kernel(compiled)(*stacked[0]).float()
    torch.testing.assert_close(compiled(*stacked[0]).float(), reference, rtol=0, atol=0.02 * reference.abs().max())
    results.append(streaming_summary(f"{name}, compiled", "experts", *times, weight_bytes=weight_bytes))
    return results


def print_table(report: dict) -> None:
    header = f"{'case':46} {'torch ms':>9} {'kernel ms':>10} {'torch/kernel':>13} {'min..max':>12}"
    print(f"CPU kernels vs the torch paths, {report['environment']['threads']} thread(s)")
    print(header)
    for row in report["results"]:
        print(
            f"{row['name']:46} {row['reference_ms']:9.3f} {row['kernel_ms']:10.3f} {row['ratio_median']:12.2f}x "
            f"{row['ratio_min']:5.2f}..{row['ratio_max']:<5.2f}"
        )
    for name, available in report["kernels_available"].items():
        if not available:
            print(f"  {name}: the kernel cannot run here; both columns are the torch path")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 rounds (smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 20, quick 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "bench_cpu_kernels.json")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    repeats = args.repeats or (3 if args.quick else 20)

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with torch.inference_mode():
            evict = torch.empty(EVICT_BYTES, dtype=torch.uint8)
            results = bench_kda(repeats, evict)
            results += [bench_fp8(*shape, repeats) for shape in (QUICK_FP8_SHAPES if args.quick else FP8_SHAPES)]
            results += [bench_row(*shape, repeats, evict) for shape in (QUICK_ROW_SHAPES if args.quick else ROW_SHAPES)]
            results += [bench_mla(*shape, repeats, evict) for shape in (QUICK_MLA_SHAPES if args.quick else MLA_SHAPES)]
            for shape in QUICK_EXPERT_SHAPES if args.quick else EXPERT_SHAPES:
                results += bench_experts(*shape, repeats, evict)
    finally:
        torch.set_num_threads(threads)
    report = dict(
        environment=dict(
            threads=args.threads, torch=torch.__version__, machine=platform.machine(), processor=platform.processor()
        ),
        kernels_available=dict(
            kda=cpu_kda_recurrent.kernel_available(),
            fp8=cpu_fp8_dequantize.kernel_available(),
            row=cpu_row_linear.kernel_available(),
            mla=cpu_head_products.kernel_available(),
            experts=cpu_expert_linear.kernel_available(),
        ),
        repeats=repeats,
        results=results,
    )
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
