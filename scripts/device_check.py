"""Device check: every paged-DSA kernel backend of an accelerator against the `cpu` backend, in one short command.

    python scripts/device_check.py                 # on an Ascend NPU (torch_npu) or a CUDA GPU
    python scripts/device_check.py --dry-run       # the CPU-side self-check of this script (no device needed)

What it runs (docs/backends.md §5), per backend (`npu` on an NPU, `triton` on CUDA, `torch` everywhere), inputs built
on the CPU and moved to the device, dims the fused Ascend ops accept (index head dim 128, latent 512, RoPE 64),
bf16, batch 2 with a left-padded sequence, pages in shuffled order:
  1. indexer top-k recall against the `cpu` backend's selection, prefill (a 128-query block) and decode;
  2. sparse attention and dense MLA outputs against the `cpu` backend (relative Frobenius error), and the k-pool
     indexer's recall (GLM-5.3-Flash, docs/dsa.md §9) where the backend has one;
  3. generate equality: a tiny KDA + DSA + dense-MLA model, greedy, the backend's DSA kernels (its KDA kernels
     swapped for the torch ones: they round differently, item 5 checks them) against `torch` on the same device and
     against the `cpu` backend on the CPU (reported, not gated);
  4. a decode-step timing table (indexer + sparse attention, batch 1, DeepSeek-V3.2-like dims: 16 heads, 64
     indexer heads, index_topk 2048) at contexts 4k and 64k, median of --repeats synchronised calls;
  5. the backend's KDA kernels that are not the torch reference (fla's Triton `chunk_kda` / `fused_recurrent_kda` for
     `triton`, torch_npu's recurrent gated delta rule for `npu`) against kda_ops' torch kernels;
  6. once per run, graph mode: generate()'s compiled decode step on the static cache against eager greedy tokens
     (fp32); on CUDA under CUDA graphs (`mode="reduce-overhead"`), which inductor must not have skipped
     (`--skip-graph-mode` leaves it out).
Prints a table, writes JSON (default runs/device_check.json) and exits 1 when a check misses its bound. A check that
raises is recorded as a failed row with its error and the run goes on to the next one; the JSON is rewritten after
every check, so a run cut short (a device lease's time limit) still leaves what it measured.
"""

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from modeling_kdsa import KDSAConfig, KDSAForCausalLM, kernels  # noqa: E402
from modeling_kdsa.cache import KDSACache, KDSAPagedKPoolLayer  # noqa: E402
from modeling_kdsa.dsa_paged_common import PagedKeys  # noqa: E402
from modeling_kdsa.kda_ops import chunk_kda, l2norm, recurrent_kda  # noqa: E402
from modeling_kdsa.kernels import CPU_KERNELS, TORCH_KERNELS, kernel_set  # noqa: E402
from modeling_kdsa.numeric_formats import SplitRows  # noqa: E402

DTYPE = torch.bfloat16
PAGE_SIZE = 64
INDEX_DIM, LATENT, ROPE = 128, 512, 64
MIN_RECALL = 0.98  # bf16 products swap near-equal keys at the top-k boundary (tests/test_dsa_paged_ops.py)
MAX_REL_ERROR = 2e-2  # bf16 attention outputs: a few bf16 roundings (2^-8 relative each)
CHECK_CASES = [("prefill", 300, 128), ("decode", 300, 1)]  # (kind, context, queries)
DRY_CHECK_CASES = [("prefill", 100, 16), ("decode", 100, 1)]


def detect_device() -> str:
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return "npu"
    except ImportError:
        pass
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize(device: str) -> None:
    if device == "npu":
        torch.npu.synchronize()
    elif device == "cuda":
        torch.cuda.synchronize()


def paged_inputs(num_keys: int, num_queries: int, heads: int, index_heads: int, seed: int, batch: int = 2) -> dict:
    """Random CPU inputs for the last `num_queries` positions of a `num_keys` context, pages shuffled, sequence 1
    left-padded by 5 tokens (when batch > 1)."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_sequence = -(-num_keys // PAGE_SIZE)
    num_pages = batch * pages_per_sequence + 3
    block_table = torch.randperm(num_pages, generator=generator)[: batch * pages_per_sequence]
    padding = torch.ones(batch, num_keys, dtype=torch.bool)
    padding[1:, :5] = False

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(DTYPE)

    return {
        "q_index": randn(batch, num_queries, index_heads, INDEX_DIM),
        "weights": torch.randn(batch, num_queries, index_heads, generator=generator),
        "index_pages": randn(num_pages, PAGE_SIZE, INDEX_DIM),
        "kv_pages": randn(num_pages, PAGE_SIZE, LATENT + ROPE),
        "q_latent": randn(batch, num_queries, heads, LATENT, scale=0.05),
        "q_pe": randn(batch, num_queries, heads, ROPE, scale=0.05),
        "block_table": block_table.view(batch, pages_per_sequence),
        "padding": padding,
        "num_keys": num_keys,
        "query_start": num_keys - num_queries,
    }


def to_device(inputs: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def store_layout(inputs: dict, backend: str) -> dict:
    """`inputs` with `kv_pages` as the backend's store keeps them: latent and RoPE planes on `npu` (docs/backends.md
    §2), one `[N, P, C + R]` tensor elsewhere."""
    if backend != "npu":
        return inputs
    return {**inputs, "kv_pages": SplitRows.split(inputs["kv_pages"], LATENT)}


def run_kernels(backend: str, inputs: dict, index_topk: int):
    """A backend's indexer top-k on `inputs`, and its sparse attention and dense MLA kernels."""
    kernels = kernel_set(backend)
    indices = kernels.require("indexer_topk")(inputs["q_index"], inputs["weights"], paged_keys(inputs), index_topk)
    return indices, kernels.require("sparse_mla"), kernels.require("dense_mla")


def paged_keys(inputs: dict, pages: str = "index_pages") -> PagedKeys:
    """The paged keys of `inputs` that the kernels take (`dsa_paged_common.PagedKeys`), over the plane `pages`."""
    i = inputs
    return PagedKeys(i[pages], i["block_table"], i["num_keys"], i["query_start"], i["padding"])


def check_kpool(backend: str, device: str, index_topk: int = 64, kpool: int = 4) -> list[dict]:
    """The k-pool indexer (docs/dsa.md §9) of a backend against the `cpu` backend's, over a store built on the CPU
    (left padding that shifts the pools, pools completed across appends), prefill block and decode."""
    kernel = kernel_set(backend).kpool_indexer_topk
    if kernel is None:
        return []  # not implemented by this backend (triton)
    generator = torch.Generator().manual_seed(5)
    num_keys, pads = 300, (0, 5)
    mask = torch.ones(2, num_keys, dtype=torch.bool)
    for b, pad in enumerate(pads):
        mask[b, :pad] = False
    ape = torch.randn(kpool, INDEX_DIM, generator=generator).to(DTYPE)
    store = KDSAPagedKPoolLayer(8, INDEX_DIM, "cpu", page_size=PAGE_SIZE, index_kpool=kpool)
    rows = torch.randn(2, num_keys, 2 * INDEX_DIM, generator=generator).to(DTYPE)
    for start, stop in ((0, 97), (97, num_keys)):
        store.append(torch.zeros(2, stop - start, 8, dtype=DTYPE), rows[:, start:stop], mask[:, :stop], ape)
    results = []
    for kind, num_queries in (("prefill", 128), ("decode", 1)):
        q_index = torch.randn(2, num_queries, 16, INDEX_DIM, generator=generator).to(DTYPE)
        weights = torch.randn(2, num_queries, 16, generator=generator)
        keys = PagedKeys(store.index_pages, store.block_table, num_keys, num_keys - num_queries, mask, store.pool_pages)
        expected = CPU_KERNELS.kpool_indexer_topk(q_index, weights, keys, index_topk, ape, True)
        dev_keys = PagedKeys(*(part.to(device) if isinstance(part, torch.Tensor) else part for part in keys))
        got = kernel(q_index.to(device), weights.to(device), dev_keys, index_topk, ape.to(device), True)
        row = {"backend": backend, "case": f"k-pool {kind} S={num_keys} T={num_queries}"}
        row["indexer_recall"] = recall(got.cpu(), expected)
        row["ok"] = row["indexer_recall"] >= MIN_RECALL
        results.append(row)
    return results


def recall(selected: torch.Tensor, expected: torch.Tensor) -> float:
    hits = total = 0
    for got, want in zip(selected.flatten(0, 1).tolist(), expected.flatten(0, 1).tolist(), strict=True):
        want = {w for w in want if w >= 0}
        hits += len({g for g in got if g >= 0} & want)
        total += len(want)
    return hits / max(total, 1)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float().cpu() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30))


def check_kernels(backend: str, device: str, cases, index_topk: int) -> list[dict]:
    rows = []
    scale = (128 + ROPE) ** -0.5
    for kind, num_keys, num_queries in cases:
        cpu_inputs = paged_inputs(num_keys, num_queries, heads=4, index_heads=8, seed=num_keys + num_queries)
        dev_inputs = store_layout(to_device(cpu_inputs, device), backend)
        expected_indices, cpu_sparse, cpu_dense = run_kernels("cpu", cpu_inputs, index_topk)
        indices, sparse_mla, dense = run_kernels(backend, dev_inputs, index_topk)
        c, d = cpu_inputs, dev_inputs
        cpu_keys, dev_keys = paged_keys(c, "kv_pages"), paged_keys(d, "kv_pages")
        sparse_expected = cpu_sparse(c["q_latent"], c["q_pe"], cpu_keys, expected_indices, scale)
        sparse_got = sparse_mla(d["q_latent"], d["q_pe"], dev_keys, expected_indices.to(device), scale)
        dense_expected = cpu_dense(c["q_latent"], c["q_pe"], cpu_keys, scale)
        dense_got = dense(d["q_latent"], d["q_pe"], dev_keys, scale)
        row = {
            "backend": backend,
            "case": f"{kind} S={num_keys} T={num_queries}",
            "indexer_recall": recall(indices.cpu(), expected_indices),
            "sparse_rel_error": relative_error(sparse_got, sparse_expected),
            "dense_rel_error": relative_error(dense_got, dense_expected),
        }
        row["ok"] = (
            row["indexer_recall"] >= MIN_RECALL
            and row["sparse_rel_error"] <= MAX_REL_ERROR
            and row["dense_rel_error"] <= MAX_REL_ERROR
        )
        rows.append(row)
    return rows


def tiny_model(backend: str, device: str) -> KDSAForCausalLM:
    """KDA + DSA + dense MLA with the fused ops' dims (seeded: every call builds the same weights). 16 indexer heads:
    with fewer, exact-zero scores tie at the top-k boundary and backends may keep different keys (docs/backends.md
    §3)."""
    torch.manual_seed(0)
    config = KDSAConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
        layer_types=["linear_attention", "indexed_attention", "full_attention"], linear_num_heads=2,
        linear_head_dim=16, q_lora_rank=32, kv_lora_rank=LATENT, qk_nope_head_dim=16, qk_rope_head_dim=ROPE,
        v_head_dim=16, index_n_heads=16, index_head_dim=INDEX_DIM, index_topk=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, attn_res_block_size=0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, kernel_backend=backend,
    )  # fmt: skip
    return KDSAForCausalLM(config).eval().to(device=device, dtype=DTYPE)


def padded_prompts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random 70-token prompts, the second left-padded by 6, and their attention mask."""
    prompt = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(prompt)
    prompt[1, :6], mask[1, :6] = 0, 0
    return prompt, mask


def generate_tokens(backend: str, device: str, new_tokens: int) -> torch.Tensor:
    prompt, mask = padded_prompts(seed=1)
    model = tiny_model(backend, device)
    with torch.inference_mode():
        out = model.generate(
            prompt.to(device), attention_mask=mask.to(device), cache=KDSACache(model.config),
            max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out.cpu()


@contextlib.contextmanager
def torch_kda(backend: str):
    """The registry's `backend` with the torch KDA kernels while inside (so a generate compares DSA kernels only)."""
    build = kernels._BACKENDS[backend]
    kda = dict(kda_chunk=TORCH_KERNELS.kda_chunk, kda_recurrent=TORCH_KERNELS.kda_recurrent)
    kernels._BACKENDS[backend] = lambda: dataclasses.replace(build(), **kda)
    try:
        yield
    finally:
        kernels._BACKENDS[backend] = build


def check_generate(backend: str, device: str, new_tokens: int) -> dict:
    with torch_kda(backend):
        tokens = generate_tokens(backend, device, new_tokens)
    on_device_reference = generate_tokens("torch", device, new_tokens)
    on_cpu = generate_tokens("cpu", "cpu", new_tokens)
    return {
        "backend": backend,
        "equal_to_torch_on_device": bool(torch.equal(tokens, on_device_reference)),
        "equal_to_cpu_backend": bool(torch.equal(tokens, on_cpu)),
        "ok": bool(torch.equal(tokens, on_device_reference)),
    }


def check_graph_mode(device: str, new_tokens: int) -> dict:
    """generate()'s own compiled decode step (`cache_implementation="static"` + a `CompileConfig`, docs/graph-mode.md
    §2) against eager greedy decoding on the paged cache, the tiny model in fp32 (so that compiled and eager kernels
    round alike enough to keep every greedy token). On CUDA the step runs under CUDA graphs
    (`mode="reduce-overhead"`, transformers' default, docs/graph-mode.md §5): the check also requires that inductor
    skipped none (`cudagraph_skips`). Elsewhere `mode="default"`."""
    from transformers import CompileConfig

    mode = "reduce-overhead" if device == "cuda" else "default"
    config = CompileConfig(fullgraph=True, mode=mode)
    config._compile_all_devices = True  # generate() compiles on CUDA only unless told
    prompt, mask = padded_prompts(seed=2)
    model = tiny_model("auto", device).float()
    run = dict(attention_mask=mask.to(device), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        eager = model.generate(prompt.to(device), pad_token_id=0, **run).cpu()
        start = time.perf_counter()
        compiled = model.generate(
            prompt.to(device), pad_token_id=0, cache_implementation="static", compile_config=config, **run
        ).cpu()
        seconds = time.perf_counter() - start
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    equal = bool(torch.equal(eager, compiled))
    return {
        "mode": mode,
        "new_tokens": new_tokens,
        "equal_to_eager": equal,
        "graphs_compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "cudagraph_skips": skips,
        "compile_and_generate_s": seconds,
        "ok": graph_mode_passed(equal, mode, skips),
    }


def graph_mode_passed(equal_to_eager: bool, mode: str, cudagraph_skips: int) -> bool:
    """Eager's tokens, and under CUDA graphs no step that inductor left out of them."""
    return equal_to_eager and (mode != "reduce-overhead" or cudagraph_skips == 0)


def time_decode(backend: str, device: str, contexts, repeats: int, heads: int, index_heads: int, topk: int):
    rows = []
    kernels = kernel_set(backend)
    indexer, sparse_mla = kernels.require("indexer_topk"), kernels.require("sparse_mla")
    scale = (128 + ROPE) ** -0.5
    for num_keys in contexts:
        i = store_layout(to_device(paged_inputs(num_keys, 1, heads, index_heads, seed=7, batch=1), device), backend)

        def step(i=i, num_keys=num_keys):
            keys = PagedKeys(i["index_pages"], i["block_table"], num_keys, num_keys - 1)
            indices = indexer(i["q_index"], i["weights"], keys, topk)
            return sparse_mla(i["q_latent"], i["q_pe"], keys._replace(pages=i["kv_pages"]), indices, scale)

        step()  # warm-up (kernel selection, allocator)
        times = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
        rows.append({"backend": backend, "context": num_keys, "decode_step_ms": statistics.median(times)})
    return rows


def check_kda(backend: str, device: str) -> list[dict]:
    """The backend's KDA kernels that are not the torch reference, against kda_ops (fp32 inputs, a 256-token prefill
    with an initial state, a 1-token and an 11-token decode call), by relative error (bf16 ops round their inputs)."""
    kernels = kernel_set(backend)
    generator = torch.Generator().manual_seed(3)
    shape = (2, 256, 4, 64)
    q, k = (l2norm(torch.randn(shape, generator=generator)) for _ in range(2))
    v = torch.randn(shape, generator=generator)
    g = -torch.rand(shape, generator=generator) * 0.1
    beta = torch.rand(shape[:3], generator=generator)
    state = torch.randn(2, 4, 64, 64, generator=generator) * 0.1
    rows = []
    for name, reference, steps in (("kda_chunk", chunk_kda, 256), ("kda_recurrent", recurrent_kda, 1)):
        kernel = kernels.require(name)
        if kernel is reference:
            continue
        for tokens in (steps, 11) if name == "kda_recurrent" else (steps,):
            inputs = [x[:, :tokens] for x in (q, k, v, g, beta)]
            expected, expected_state = reference(*inputs, initial_state=state, output_final_state=True)
            got, got_state = kernel(
                *(x.to(device) for x in inputs), initial_state=state.to(device), output_final_state=True
            )
            error = max(relative_error(got, expected), relative_error(got_state, expected_state))
            rows.append({"backend": backend, "kernel": f"{name} T={tokens}", "rel_error": error})
            rows[-1]["ok"] = error <= MAX_REL_ERROR
    return rows


def guarded(section: str, backend: str, check, *args, **kwargs) -> list[dict]:
    """`check(*args, **kwargs)`'s rows; if it raises, one failed row naming the section, backend and error instead
    (traceback on stderr), so that the other checks still run and report: device time is scarce, and one broken
    kernel must not hide the others' results."""
    try:
        return check(*args, **kwargs)
    except Exception as error:  # noqa: BLE001  (any failure of a check is a result to report)
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}"[:2000]
        return [{"backend": backend, "section": section, "error": message, "ok": False}]


def failed(rows: list[dict]) -> list[dict]:
    """The rows that record a check that raised (`guarded`)."""
    return [row for row in rows if "error" in row]


def completed(rows: list[dict]) -> list[dict]:
    """The rows of checks that ran to the end (not `failed`)."""
    return [row for row in rows if "error" not in row]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "npu", "cuda", "cpu"])
    parser.add_argument("--backends", nargs="+", default=None, help="default: npu+torch on NPU, triton+torch on CUDA")
    parser.add_argument("--dry-run", action="store_true", help="CPU self-check: small contexts, device cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per context (default 10, dry 2)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "device_check.json")
    parser.add_argument("--skip-graph-mode", action="store_true", help="no compiled generate (item 6)")
    args = parser.parse_args(argv)

    device = "cpu" if args.dry_run and args.device == "auto" else args.device
    device = detect_device() if device == "auto" else device
    default_backends = {"npu": ["npu", "torch"], "cuda": ["triton", "torch"]}
    backends = args.backends or default_backends.get(device, ["torch"])
    cases = DRY_CHECK_CASES if args.dry_run else CHECK_CASES
    contexts = [512, 2048] if args.dry_run else [4096, 65536]
    repeats = args.repeats or (2 if args.dry_run else 10)
    timing_dims = dict(heads=4, index_heads=8, topk=64) if args.dry_run else dict(heads=16, index_heads=64, topk=2048)

    sections = ("kernels", "kpool", "generate", "decode_timing", "kda", "graph_mode")
    report = {"device": device, "dry_run": args.dry_run, **{section: [] for section in sections}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def run(section: str, backend: str, check, *check_args, **check_kwargs) -> None:
        report[section] += guarded(section, backend, check, *check_args, **check_kwargs)
        args.out.write_text(json.dumps(report, indent=2))  # after every check: a cut-short run keeps what it measured

    new_tokens = 4 if args.dry_run else 8
    for backend in backends:
        run("kda", backend, check_kda, backend, device)
        run("kernels", backend, check_kernels, backend, device, cases, index_topk=64)
        run("kpool", backend, check_kpool, backend, device)
        run("generate", backend, lambda backend=backend: [check_generate(backend, device, new_tokens)])
        run("decode_timing", backend, time_decode, backend, device, contexts, repeats, **timing_dims)
    if not args.skip_graph_mode:
        run("graph_mode", "auto", lambda: [check_graph_mode(device, 8 if args.dry_run else 32)])

    print(f"device: {device}{' (dry run)' if args.dry_run else ''}")
    print(f"{'backend':8} {'case':22} {'recall':>7} {'sparse err':>11} {'dense err':>10}  ok")
    for row in completed(report["kernels"]):
        print(
            f"{row['backend']:8} {row['case']:22} {row['indexer_recall']:7.4f} {row['sparse_rel_error']:11.2e} "
            f"{row['dense_rel_error']:10.2e}  {'yes' if row['ok'] else 'NO'}"
        )
    for row in completed(report["kpool"]):
        print(f"{row['backend']:8} {row['case']:30} recall {row['indexer_recall']:.4f}  {'yes' if row['ok'] else 'NO'}")
    for row in completed(report["generate"]):
        print(
            f"generate {row['backend']}: == torch on {device}: {row['equal_to_torch_on_device']}, "
            f"== cpu backend on cpu: {row['equal_to_cpu_backend']}"
        )
    print(f"{'backend':8} {'context':>8} {'decode step ms':>15}")
    for row in completed(report["decode_timing"]):
        print(f"{row['backend']:8} {row['context']:8d} {row['decode_step_ms']:15.3f}")
    print(f"wrote {args.out}")
    for row in completed(report["kda"]):
        verdict = "yes" if row["ok"] else "NO"
        print(f"{row['backend']:8} {row['kernel']:18} rel error vs kda_ops {row['rel_error']:.2e}  {verdict}")
    for row in completed(report["graph_mode"]):
        print(
            f"graph mode ({row['mode']}): {row['new_tokens']} tokens == eager: {row['equal_to_eager']}, "
            f"{row['graphs_compiled']} graph(s), CUDA graph skips {row['cudagraph_skips']}, "
            f"{row['compile_and_generate_s']:.1f} s  {'yes' if row['ok'] else 'NO'}"
        )
    checks = report["kernels"] + report["kpool"] + report["generate"] + report["kda"] + report["graph_mode"]
    errors = failed(checks + report["decode_timing"])
    for row in errors:
        print(f"ERROR in {row['section']} ({row['backend']}): {row['error']}")
    passed = all(row["ok"] for row in checks) and not errors
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
