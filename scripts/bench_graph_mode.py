"""Graph-mode benchmark: the whole KDSA decode step eager vs compiled (docs/graph-mode.md §6).

At each context (default 4k; batch 1, or `--batch` sequences; bf16; the benchmark shape = KDSAConfig defaults, as
bench_long_context.py):
  1. eager step with the paged `KDSACache` (what generate() runs by default);
  2. eager step with `KDSAStaticCache` (no compile: the same paged kernels over the cached tokens);
  3. compiled step with `KDSAStaticCache`: the very callable generate() uses (`model.get_compiled_call(
     CompileConfig(fullgraph=True, mode="default"))`), i.e. the whole step as one inductor graph.
Eager-static and compiled steps alternate, one pair per repeat, so both see the same machine state; the ratio is taken
per pair (min and median reported). The compiled step's logits are compared with the eager-static step's on the same
cache contents, and the number of graphs compiled over all steps is reported (1 = no recompile as the context grows).
  4. the same compiled step with dynamo's guard evaluation skipped (`torch.compiler.set_stance(
     skip_guard_eval_unsafe=True)`, once the step is compiled; docs/graph-mode.md §6, §11): the host time its guards
     cost, interleaved with the others, and its logits compared with the guarded step's (measured only: the product
     keeps the guards);
  5. the step as an AOTInductor package (`modeling_kdsa.aot`, docs/graph-mode.md §14): the same fixed-shape step
     exported and compiled ahead of time, behind a C++ wrapper with no guards, on its own static cache filled alike
     and called as generate() calls it (the model's forward, which hands a plain step to the package bound to the
     cache); its logits compared with the eager step's, its compile and load times reported (`--skip-aot`: not run);
     then whole `model.generate` calls of `GENERATE_TOKENS` greedy tokens from the filled caches, interleaved: the
     default paged cache (eager), the static cache with generate()'s compiled step, and the package's cache — the
     per-token time a user sees, generate()'s own work included;
  6. an operator profile (torch.profiler) of the steps: the top operators and the aten calls per step;
  7. compile time of the compiled step, cold and warm: this process compiles it first in a new, empty inductor cache
     directory (cold: its first compiled call at the first context), then a fresh process with the same batch and
     context reuses that directory (warm, as a second run of a user's program would); each with its FX-graph cache hits
     and misses (cold: misses only; warm: hits only).

Caches are filled with random rows / states through their own write paths (no prefill), so long contexts are cheap.

Usage:  .venv/bin/python scripts/bench_graph_mode.py [--quick] [--contexts 4096 65536] [--repeats 10] [--batch 1]
        [--skip-aot] [--out PATH] [--inductor-options NAME=VALUE ...]   (CompileConfig.options, e.g. freezing=true)
Writes JSON (default runs/bench_graph_mode.json) and prints a table.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._dynamo.utils
from tqdm import tqdm
from transformers import CompileConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))  # train_tiny: the tiny model's shape

from modeling_kdsa.aot import compile_decode_step, load_decode_step  # noqa: E402
from train_tiny import tiny_config  # noqa: E402

from modeling_kdsa import KDSAConfig, KDSAForCausalLM  # noqa: E402
from modeling_kdsa.cache import KDSACache, KDSAPagedMLALayer  # noqa: E402
from modeling_kdsa.configuration_kdsa import KDA_LAYER  # noqa: E402
from modeling_kdsa.static_cache import KDSAStaticCache  # noqa: E402

DTYPE = torch.bfloat16


def bench_config(quick: bool) -> KDSAConfig:
    """The benchmark shape (KDSAConfig defaults, positions raised for 64k); `--quick` a small model of every layer
    kind, so that the smoke test compiles in seconds: the shipped tiny model's shape (scripts/train_tiny.py) with a
    dense MLA layer, no special tokens."""
    if not quick:
        return KDSAConfig(max_position_embeddings=1 << 17)
    return tiny_config(
        256,
        64,
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "full_attention"],
        index_n_heads=2,
        moe_intermediate_size=64,
        attn_res_block_size=2,
        max_position_embeddings=4096,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def build_model(config: KDSAConfig) -> KDSAForCausalLM:
    torch.manual_seed(0)
    return KDSAForCausalLM(config).to(DTYPE).eval()


def compile_config(options: dict | None = None) -> CompileConfig:
    """generate()'s compile config; `options`: inductor settings (torch.compile takes them instead of a mode)."""
    config = CompileConfig(fullgraph=True, mode=None if options else "default", options=options or None)
    config._compile_all_devices = True  # generate()'s switch to compile on CPU
    return config


def fill(cache, config: KDSAConfig, context: int, batch: int = 1, seed: int = 0):
    """`context` random tokens of `batch` sequences in every layer of `cache` (`KDSACache` or `KDSAStaticCache`)
    through the layers' own writes: paged rows `[c | k_pe]` (and indexer keys) for DSA / dense MLA layers, conv window
    and fp32 state for KDA."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=DTYPE, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(dtype)

    for layer_type, layer in zip(config.layer_types, cache.layers, strict=True):
        if isinstance(layer, KDSAPagedMLALayer):
            rows = [randn(batch, context, width) for width in layer.row_widths]
            layer._write(*rows)
        else:
            assert layer_type == KDA_LAYER
            heads, dim = config.linear_num_heads, config.linear_head_dim
            layer.update_conv_state(randn(batch, 3 * heads * dim, config.linear_conv_kernel_dim))
            layer.update_recurrent_state(randn(batch, heads, dim, dim, dtype=torch.float32, scale=0.1))
    cache.begin_forward(context) if isinstance(cache, KDSAStaticCache) else setattr(cache, "num_tokens", context)
    return cache


def step_inputs(cache, batch: int = 1) -> dict:
    return dict(input_ids=torch.full((batch, 1), 7), cache=cache, use_cache=True, logits_to_keep=1)


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


GENERATE_TOKENS = 32  # new tokens per timed generate() call (section 5)


def static_capacity(context: int, repeats: int) -> int:
    """Tokens a static cache of `measure_context` must hold: the context, then per cache the two checking steps, the
    `repeats` timed ones and the profiled ones (2 · repeats + 8 covers them for any repeats ≥ 0), or a generate()
    call's tokens (section 5: from the refilled context)."""
    return context + max(2 * repeats + 8, GENERATE_TOKENS + 1)


def measure_context(
    model,
    config: KDSAConfig,
    context: int,
    repeats: int,
    options: dict | None = None,
    batch: int = 1,
    capacity: int | None = None,
    aot_dir: Path | None = None,
) -> dict:
    """Eager and compiled whole steps at `context` cached tokens. The static caches hold `capacity` tokens (default:
    `static_capacity(context, repeats)`); steps on caches of another capacity recompile the step once (dynamo's
    automatic dynamic shapes), so callers timing several contexts cheaply may pass one capacity for all. `aot_dir`:
    where the AOTInductor packages go (one per batch and capacity, reused by later contexts of the same capacity);
    None: no AOTInductor step."""
    capacity = capacity or static_capacity(context, repeats)
    aot = aot_decode_step(model, config, context, batch, capacity, aot_dir) if aot_dir else None
    dynamic = fill(KDSACache(config), config, context, batch)
    eager_static = fill(KDSAStaticCache(config, capacity), config, context, batch)
    compiled_static = fill(KDSAStaticCache(config, capacity), config, context, batch)
    unguarded_static = fill(KDSAStaticCache(config, capacity), config, context, batch)
    compiled = model.get_compiled_call(compile_config(options))

    def unguarded(**inputs):
        """The compiled step without guard evaluation. Safe here: the guarded call below compiles (or recompiles) the
        step for this context's shapes first, and under this stance dynamo still checks the guards that tell its graphs
        apart; the logits are compared too."""
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return compiled(**inputs)

    torch._dynamo.utils.counters.clear()

    with torch.inference_mode():
        eager_logits = model(**step_inputs(eager_static, batch)).logits
        first_call_s = timed(lambda: compiled(**step_inputs(compiled_static, batch)))  # compiles (or loads from disk)
        first_call_cache = fx_graph_cache()
        compiled_logits = compiled(**step_inputs(compiled_static, batch)).logits
        eager_logits = model(**step_inputs(eager_static, batch)).logits  # same cache contents: the second step of each
        max_abs_diff = (compiled_logits.float() - eager_logits.float()).abs().max().item()
        unguarded(**step_inputs(unguarded_static, batch))
        unguarded_logits = unguarded(**step_inputs(unguarded_static, batch)).logits  # the compiled one's second step
        unguarded_diff = (unguarded_logits.float() - compiled_logits.float()).abs().max().item()
        if aot:  # through the model's forward, as generate() calls it: the cache hands the step to the package
            model(**step_inputs(aot["cache"], batch))
            aot_logits = model(**step_inputs(aot["cache"], batch)).logits
            aot["max_abs_logit_diff"] = (aot_logits.float() - eager_logits.float()).abs().max().item()
        model(**step_inputs(dynamic, batch))  # warm-up
        dynamic_s, eager_s, compiled_s, unguarded_s, aot_s = [], [], [], [], []
        for _ in tqdm(range(repeats), desc=f"context {context}", leave=False):
            dynamic_s.append(timed(lambda: model(**step_inputs(dynamic, batch))))
            eager_s.append(timed(lambda: model(**step_inputs(eager_static, batch))))
            compiled_s.append(timed(lambda: compiled(**step_inputs(compiled_static, batch))))
            unguarded_s.append(timed(lambda: unguarded(**step_inputs(unguarded_static, batch))))
            if aot:
                aot_s.append(timed(lambda: model(**step_inputs(aot["cache"], batch))))
        profiles = dict(
            eager_paged=op_profile(lambda: model(**step_inputs(dynamic, batch))),
            eager_static=op_profile(lambda: model(**step_inputs(eager_static, batch))),
            compiled_static=op_profile(lambda: compiled(**step_inputs(compiled_static, batch))),
            compiled_unguarded=op_profile(lambda: unguarded(**step_inputs(unguarded_static, batch))),
        )
        graphs_compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if aot:
            profiles["aot_package"] = op_profile(lambda: model(**step_inputs(aot["cache"], batch)))
            aot["generate"] = generate_per_token(
                model, config, context, batch, options, compiled_static, aot["cache"], 1 if repeats < 5 else 5
            )
    ratios = [e / c for e, c in zip(eager_s, compiled_s, strict=True)]
    unguarded_ratios = [e / c for e, c in zip(eager_s, unguarded_s, strict=True)]
    times = dict(
        eager_paged=dynamic_s, eager_static=eager_s, compiled_static=compiled_s, compiled_unguarded=unguarded_s
    )
    aot_figures = {}
    if aot:
        times["aot_package"] = aot_s
        aot_ratios = [e / a for e, a in zip(eager_s, aot_s, strict=True)]
        aot_figures = dict(
            aot_package_s=statistics.median(aot_s),
            aot_min_s=min(aot_s),
            aot_speedup_median=statistics.median(aot_ratios),
            aot_speedup_min=min(aot_ratios),
            aot_speedup_max=max(aot_ratios),
            aot_vs_compiled_median=statistics.median([c / a for c, a in zip(compiled_s, aot_s, strict=True)]),
            aot_max_abs_logit_diff=aot["max_abs_logit_diff"],
            aot_compile_s=aot["compile_s"],
            aot_load_s=aot["load_s"],
            generate_ms_per_token=aot["generate"],
        )
    return dict(
        context=context,
        eager_paged_s=statistics.median(dynamic_s),
        eager_static_s=statistics.median(eager_s),
        compiled_static_s=statistics.median(compiled_s),
        compiled_min_s=min(compiled_s),
        eager_static_min_s=min(eager_s),
        speedup_median=statistics.median(ratios),
        speedup_min=min(ratios),
        speedup_max=max(ratios),
        speedup_vs_paged=statistics.median(dynamic_s) / statistics.median(compiled_s),
        compiled_unguarded_s=statistics.median(unguarded_s),
        unguarded_speedup_median=statistics.median(unguarded_ratios),
        unguarded_speedup_min=min(unguarded_ratios),
        unguarded_speedup_max=max(unguarded_ratios),
        guard_saving_median=statistics.median([c / u for c, u in zip(compiled_s, unguarded_s, strict=True)]),
        unguarded_max_abs_logit_diff=unguarded_diff,
        first_compiled_call_s=first_call_s,
        first_compiled_call_fx_graph_cache=first_call_cache,
        graphs_compiled=graphs_compiled,
        max_abs_logit_diff=max_abs_diff,
        **aot_figures,
        times_s=times,
        op_profile=profiles,
    )


def aot_decode_step(model, config: KDSAConfig, context: int, batch: int, capacity: int, aot_dir: Path) -> dict:
    """The decode step as an AOTInductor package on its own static cache filled like the others: the package of this
    batch and capacity is compiled into `aot_dir` unless there (`compile_s`: None then), then loaded (`load_s`)."""
    cache = fill(KDSAStaticCache(config, capacity), config, context, batch)
    path = Path(aot_dir) / f"decode-step-b{batch}-c{cache.capacity}.pt2"
    compile_s = None
    if not path.exists():
        compile_s = timed(lambda: compile_decode_step(model, cache, path))
    start = time.perf_counter()
    load_decode_step(path, model, cache)  # binds the package to the cache
    return dict(cache=cache, compile_s=compile_s, load_s=time.perf_counter() - start)


def generate_per_token(model, config, context, batch, options, compiled_cache, aot_cache, repeats) -> dict:
    """Milliseconds per token of `model.generate` (greedy, `GENERATE_TOKENS` new tokens after a context of `context`
    random tokens; the prompt's last token is the only one fed) with the paged cache eager, the static cache compiled
    by generate() and the package's cache. The three alternate, `repeats` calls each; every cache is refilled before
    its call, outside the timing. Medians, and the paged call's time over each other's, pair by pair."""
    ids = torch.full((batch, context + 1), 7)
    kwargs = dict(max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS, do_sample=False)

    def refilled(cache):
        cache.reset()
        return fill(cache, config, context, batch)

    routes = dict(  # name: (a filled cache, generate()'s extra arguments)
        eager_paged=(lambda: fill(KDSACache(config), config, context, batch), {}),
        compiled_static=(lambda: refilled(compiled_cache), dict(compile_config=compile_config(options))),
        aot_package=(lambda: refilled(aot_cache), {}),
    )
    times = {name: [] for name in routes}
    for round_ in range(repeats + 1):  # round 0 warms up (and builds generate()'s compiled call for this config)
        for name, (filled, extra) in routes.items():
            cache = filled()
            seconds = timed(lambda: model.generate(ids, cache=cache, **kwargs, **extra))  # noqa: B023
            if round_:
                times[name].append(seconds * 1e3 / GENERATE_TOKENS)
    figures = {name: statistics.median(ms) for name, ms in times.items()}
    for name in ("compiled_static", "aot_package"):
        figures[f"{name}_speedup"] = statistics.median(
            [e / t for e, t in zip(times["eager_paged"], times[name], strict=True)]
        )
    return dict(new_tokens=GENERATE_TOKENS, repeats=repeats, **figures, times_ms=times)


def op_profile(call, steps: int = 3, top: int = 8) -> dict:
    """torch.profiler over `steps` calls: per-step self CPU time of the top operators, the number of aten operator
    calls per step and the step's total self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            call()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return dict(
        total_ms_per_step=sum(e.self_cpu_time_total for e in events) / 1e3 / steps,
        aten_calls_per_step=sum(e.count for e in events if e.key.startswith("aten::")) / steps,
        top=[
            dict(name=e.key[:60], self_ms_per_step=e.self_cpu_time_total / 1e3 / steps, calls_per_step=e.count / steps)
            for e in events[:top]
        ],
    )


def fx_graph_cache() -> dict:
    """This process's FX-graph cache hits and misses since dynamo's counters were last cleared."""
    counters = torch._dynamo.utils.counters["inductor"]
    return dict(fx_graph_cache_hits=counters["fxgraph_cache_hit"], fx_graph_cache_misses=counters["fxgraph_cache_miss"])


def compile_probe(quick: bool, context: int, batch: int, options: dict | None = None) -> dict:
    """Seconds to the end of the first compiled step in this process (model built and cache filled before), with the
    FX-graph cache's hits and misses."""
    config = bench_config(quick)
    model = build_model(config)
    cache = fill(KDSAStaticCache(config, context + 8), config, context, batch)
    compiled = model.get_compiled_call(compile_config(options))
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        return dict(compile_s=timed(lambda: compiled(**step_inputs(cache, batch))), **fx_graph_cache())


def warm_compile(cache_dir: str, args) -> dict:
    """`compile_probe` in a fresh process over the inductor cache directory `cache_dir`."""
    command = [sys.executable, __file__, "--compile-probe", "--contexts", str(args.contexts[0]), "--batch",
               str(args.batch), "--threads", str(torch.get_num_threads())]  # fmt: skip
    if args.quick:
        command.append("--quick")
    if args.inductor_options:
        command += ["--inductor-options", *args.inductor_options]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def print_table(report: dict) -> None:
    headers = [
        "context", "eager paged ms", "eager static ms", "compiled ms", "speedup (median)", "min..max", "graphs",
        "max |Δlogit|", "no guard eval ms", "speedup", "vs guarded",
    ]  # fmt: skip
    rows = [
        [
            f"{r['context']:,}",
            f"{r['eager_paged_s'] * 1e3:.2f}",
            f"{r['eager_static_s'] * 1e3:.2f}",
            f"{r['compiled_static_s'] * 1e3:.2f}",
            f"{r['speedup_median']:.2f}x",
            f"{r['speedup_min']:.2f}..{r['speedup_max']:.2f}",
            str(r["graphs_compiled"]),
            f"{r['max_abs_logit_diff']:.2e}",
            f"{r['compiled_unguarded_s'] * 1e3:.2f}",
            f"{r['unguarded_speedup_median']:.2f}x",
            f"{r['guard_saving_median']:.3f}x",
        ]
        for r in report["decode"]
    ]
    if all("aot_package_s" in r for r in report["decode"]):
        headers += ["AOT package ms", "speedup", "vs compiled", "max |Δlogit|"]
        for row, r in zip(rows, report["decode"], strict=True):
            row += [
                f"{r['aot_package_s'] * 1e3:.2f}",
                f"{r['aot_speedup_median']:.2f}x ({r['aot_speedup_min']:.2f}..{r['aot_speedup_max']:.2f})",
                f"{r['aot_vs_compiled_median']:.2f}x",
                f"{r['aot_max_abs_logit_diff']:.2e}",
            ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    batch = report["environment"]["batch"]
    print(f"Whole decode step, batch {batch}, bf16 (KDSAStaticCache compiled by generate()'s own compile call)")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    for r in report["decode"]:
        for name, prof in r["op_profile"].items():
            top = ", ".join(
                f"{op['name']} {op['self_ms_per_step']:.2f} ms ×{op['calls_per_step']:.0f}" for op in prof["top"][:4]
            )
            print(
                f"  {r['context']:,} {name}: {prof['total_ms_per_step']:.2f} ms/step profiled, "
                f"{prof['aten_calls_per_step']:.0f} aten calls/step; top: {top}"
            )
    for r in report["decode"]:
        if "generate_ms_per_token" in r:
            g = r["generate_ms_per_token"]
            print(
                f"model.generate ({r['context']:,} cached, {g['new_tokens']} new tokens, median of {g['repeats']}): "
                f"eager paged {g['eager_paged']:.2f} ms/token, compiled static {g['compiled_static']:.2f} "
                f"({g['compiled_static_speedup']:.2f}x), AOT package {g['aot_package']:.2f} "
                f"({g['aot_package_speedup']:.2f}x)"
            )
        if r.get("aot_compile_s") is not None:
            print(
                f"AOTInductor package ({r['context']:,}): compiled in {r['aot_compile_s']:.1f} s (export + "
                f"AOTInductor, no cache), loaded in {r['aot_load_s']:.2f} s"
            )
    if "compile" in report:
        cold, warm = report["compile"]["cold"], report["compile"]["warm"]
        print(
            f"Compile of the step: cold {cold['compile_s']:.1f} s (this process, empty inductor cache; FX-graph cache "
            f"hits/misses {cold['fx_graph_cache_hits']}/{cold['fx_graph_cache_misses']}), warm {warm['compile_s']:.1f} "
            f"s (a fresh process, the same cache; {warm['fx_graph_cache_hits']}/{warm['fx_graph_cache_misses']})"
        )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="cached tokens (default 4096)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="small model, context 128, 3 repeats (smoke test)")
    parser.add_argument(
        "--skip-compile-times", action="store_true", help="no cold/warm compile times (the inductor cache is reused)"
    )
    parser.add_argument("--skip-aot", action="store_true", help="no AOTInductor package step (saves its compile)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "bench_graph_mode.json")
    parser.add_argument(
        "--inductor-options",
        nargs="+",
        default=None,
        metavar="NAME=VALUE",
        help="torch._inductor.config settings for the compiled step (CompileConfig.options), e.g. freezing=true",
    )
    parser.add_argument("--compile-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch takes a number of sequences >= 1, got {args.batch}")
    return args


def parse_options(pairs: list[str] | None) -> dict:
    """`NAME=VALUE` pairs → inductor options; VALUE is read as JSON (true, 1, "x"), else kept as a string."""
    options = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--inductor-options takes NAME=VALUE, got {pair!r}")
        try:
            options[name] = json.loads(value)
        except json.JSONDecodeError:
            options[name] = value
    return options


def main(argv=None) -> dict:
    args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.contexts = args.contexts or ([128] if args.quick else [4096])
    options = parse_options(args.inductor_options)
    # Compile times: this process's first compile is the cold one, in an empty inductor cache directory, which the warm
    # process then reuses.
    aot_dir = None
    cache_dir = None if args.compile_probe or args.skip_compile_times else tempfile.mkdtemp(prefix="kdsa-inductor-")
    previous_cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        if args.compile_probe:
            print(json.dumps(compile_probe(args.quick, args.contexts[0], args.batch, options)))
            return {}
        repeats = 3 if args.quick and args.repeats == 10 else args.repeats
        config = bench_config(args.quick)
        model = build_model(config)
        aot_dir = None if args.skip_aot else Path(tempfile.mkdtemp(prefix="kdsa-aot-"))
        report = dict(
            command=" ".join([Path(sys.executable).name, *sys.argv]) if argv is None else f"main({argv})",
            environment=dict(
                torch=torch.__version__,
                platform=platform.platform(),
                threads=torch.get_num_threads(),
                dtype=str(DTYPE),
                batch=args.batch,
            ),
            quick=args.quick,
            inductor_options=options,
            decode=[
                measure_context(model, config, c, repeats, options, args.batch, aot_dir=aot_dir) for c in args.contexts
            ],
        )
        if cache_dir:
            first = report["decode"][0]
            cold = dict(compile_s=first["first_compiled_call_s"], **first["first_compiled_call_fx_graph_cache"])
            report["compile"] = dict(cold=cold, warm=warm_compile(cache_dir, args))
    finally:
        torch.set_num_threads(previous_threads)
        if aot_dir:
            shutil.rmtree(aot_dir, ignore_errors=True)
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
            if previous_cache_dir is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous_cache_dir
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"JSON: {args.out}")
    return report


if __name__ == "__main__":
    main()
