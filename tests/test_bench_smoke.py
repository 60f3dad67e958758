"""Smoke tests of the benchmark scripts. scripts/bench_long_context.py: `--quick` (narrow models, contexts 256 and
512, prefill 128) runs end to end in this process and writes JSON with every section and positive numbers (about
a minute and a half on an idle 2-core machine, most of it the cold/warm compile probes, so it is marked slow; its
AOTInductor package section is left out, measured by scripts/bench_graph_mode.py's smoke test below and printed
through this script's section 5c there); its same-weight
pairs (transformers' model saved, loaded by KDSA) must decode the same fp32 greedy tokens from identical caches, also
checked quickly past the top-k. scripts/bench_speculative.py: `--quick` with the shipped checkpoints. Timings are
never asserted (noisy machines).
"""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_long_context.py"
MODELS = ("KDSA", "KDSA:kimi_linear", "KimiLinear", "KDSA:glm5_next", "Glm5Next")
FAMILIES = ("kimi_linear", "glm5_next")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_long_context", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_run_writes_every_section(tmp_path):
    out = tmp_path / "bench.json"
    # One thread: with 2 cores shared with other jobs, OpenMP barriers make 2-thread runs erratic. main() restores
    # the thread count afterwards.
    # --skip-aot: test_graph_mode_bench_quick_run measures the package's step and prints its section 5c.
    load_bench().main(["--quick", "--threads", "1", "--skip-aot", "--out", str(out)])
    report = json.loads(out.read_text())

    assert report["contexts"] == [256, 512]
    assert report["environment"]["threads"] == 1
    assert report["bandwidth"]["best_gbs"] > 0
    assert set(report["parameters"]) == set(MODELS)
    assert all(count > 0 for count in report["parameters"].values())
    assert set(report["same_weights"]) == set(FAMILIES)
    for info in report["same_weights"].values():
        assert info["parameters"]["kdsa"] == info["parameters"]["peer"] > 0 and info["checkpoint_bytes"] > 0

    bandwidth = report["bandwidth"]["best_gbs"]
    for entry in report["dsa_layer_decode"]:
        for name in ("ours", "ours_compiled", "ours_dense", "DeepseekV32"):
            result = entry[name]
            assert result["median_s"] > 0
            assert result["bytes_needed"]["total_bytes"] > 0
            limit = result["limit"]
            assert limit["limit_s"] == pytest.approx(result["bytes_needed"]["total_bytes"] / (bandwidth * 1e9))
            assert limit["fraction_achieved"] == pytest.approx(limit["limit_s"] / result["median_s"])
            assert limit["percent_of_limit"] == pytest.approx(100 * limit["fraction_achieved"])
            assert result["bytes_needed"]["total_bytes"] == result["bytes_needed"]["from_cache_total_bytes"]
        # Dense reads every latent row, sparse only the top-k; at 512 cached tokens top-512 is everything.
        assert entry["ours_dense"]["bytes_needed"]["total_bytes"] >= entry["ours"]["bytes_needed"]["total_bytes"]

    for entry in report["model_decode"]:
        assert set(entry["models"]) == set(MODELS)
        for name, result in entry["models"].items():
            assert result["median_s"] > 0 and result["tokens_per_s"] > 0
            assert result["bytes_needed"]["weight_bytes"] > 0 and result["bytes_needed"]["cache_read_bytes"] > 0
            # KDSA alone: the warm-up steps + its batches (time_repeated); the pairs' token checks: 8 steps
            warmup = report["environment"]["warmup"]
            assert len(result["tokens"]) == (warmup + len(result["times_s"]) if name == "KDSA" else 8), name
        assert set(entry["pairs"]) == set(FAMILIES)
        for pair in entry["pairs"].values():
            assert pair["speedup"] > 0 and pair["bf16"]["steps"] == 8
            # bf16 logits tie often enough that the bf16 tokens may differ; fp32 ones must not.
            assert pair["fp32"]["same_tokens"] and pair["fp32"]["steps"] == 8, pair
            assert pair["fp32"]["first_step_logits_relative_difference"] < 1e-5, pair

    for entry in report["dsa_layer_decode"]:
        steady = entry["steadiness"]
        assert 2 <= steady["batches"] <= steady["max_batches"] or not steady["criterion_met"]
        assert set(steady["pair_ratios"]) == {"ours_compiled", "ours_dense", "DeepseekV32"}
        assert entry["speedup_vs_DeepseekV32"] > 0
    for entry in report["model_decode"]:
        for pair in entry["pairs"].values():
            assert pair["steadiness"]["batches"] >= 1 and pair["speedup_of_minima"] > 0

    assert report["prefill"]["context"] == 128
    assert set(report["prefill"]["pairs"]) == set(FAMILIES)
    for family, pair in report["prefill"]["pairs"].items():
        assert pair["speedup"] > 0 and pair["steadiness"]["reference"] == f"KDSA:{family}"
    assert [whole["context"] for whole in report["whole_step"]] == [256, 512]
    # --quick sizes both contexts' static caches alike: the step compiles at the first context only.
    assert [whole["graphs_compiled"] for whole in report["whole_step"]] == [1, 0]
    for whole, decode in zip(report["whole_step"], report["model_decode"], strict=True):
        assert whole["eager_paged_s"] > 0 and whole["compiled_static_s"] > 0
        calls = {name: profile["aten_calls_per_step"] for name, profile in whole["op_profile"].items()}
        assert 0 < calls["compiled_static"] < calls["eager_static"] and calls["eager_paged"] > 0
        # The compiled step's limit uses the eager decode's bytes at the same context.
        assert whole["bytes_needed"] == decode["models"]["KDSA"]["bytes_needed"]
        limit = whole["compiled_limit"]
        assert limit["fraction_achieved"] == pytest.approx(limit["limit_s"] / whole["compiled_static_s"])
        assert "aot_package_s" not in whole and "aot_limit" not in whole  # --skip-aot
    for name in MODELS:
        result = report["prefill"]["models"][name]
        assert result.get("skipped") or result["median_s"] > 0, name

    for family in FAMILIES:
        exact, as_benchmarked = report["same_tokens_after_prefill"][family]
        assert exact["dtype"] == "float32" and as_benchmarked["dtype"] == "bfloat16"
        assert exact["same_tokens"] and exact["prompt_logits_relative_difference"] < 1e-5, exact
        assert len(as_benchmarked["tokens_kdsa"]) == len(as_benchmarked["tokens_peer"]) == 8

    for name in MODELS:
        cache = report["cache"][name]
        assert cache["per_token_bytes"] > 0 and cache["fixed_state_bytes"] > 0

    graph = report["graph_mode"]
    assert [row["context"] for row in graph["decode"]] == [256, 512]
    assert all(row["eager_s"] > 0 and row["compiled_s"] > 0 for row in graph["decode"])
    # The warm process must find the cold process's graphs in the shared on-disk cache.
    assert graph["compile"]["cold"]["fx_graph_cache_misses"] > 0
    assert (
        graph["compile"]["warm"]["fx_graph_cache_hits"] > 0 and graph["compile"]["warm"]["fx_graph_cache_misses"] == 0
    )
    memory = report["dsa_layer_prefill_memory"]
    assert memory["context"] == 512 and memory["seconds"] > 0 and memory["peak_rss_growth_bytes"] >= 0
    assert report["memory_method"]


@pytest.mark.parametrize("skip_aot", [False, True])
def test_whole_step_section_hands_one_package_directory_unless_skipped(skip_aot, monkeypatch):
    """Sections 5b/5c's plumbing (`whole_step_section`), the measurements faked: under --quick both contexts share one
    static-cache capacity and one package directory (so one package serves both), --skip-aot hands none; each route's
    limit comes from its own time and the eager decode's bytes at that context."""
    bench = load_bench()
    calls = []

    def figures(model, config, context, repeats, capacity, aot_dir):
        calls.append((context, capacity, aot_dir))
        return {"compiled_static_s": 0.02, **({"aot_package_s": 0.01} if aot_dir else {})}

    monkeypatch.setattr(bench, "whole_step_figures", figures)
    decode = [{"context": c, "models": {"KDSA": {"bytes_needed": {"total_bytes": c * 1e6}}}} for c in (256, 512)]
    args = bench.parse_args(["--quick", *(["--skip-aot"] if skip_aot else [])])
    rows = bench.whole_step_section(None, None, args, decode, bandwidth=10.0)
    assert [context for context, _, _ in calls] == [256, 512] and calls[0][1] == calls[1][1] is not None
    directories = {aot_dir for _, _, aot_dir in calls}
    if skip_aot:
        assert directories == {None}
    else:
        assert len(directories) == 1 and None not in directories
    for row, context in zip(rows, (256, 512), strict=True):
        assert row["compiled_limit"]["limit_s"] == pytest.approx(context * 1e6 / 10e9)
        assert row["compiled_limit"]["fraction_achieved"] == pytest.approx(context * 1e6 / 10e9 / 0.02)
        if skip_aot:
            assert "aot_limit" not in row
        else:
            assert row["aot_limit"]["fraction_achieved"] == pytest.approx(context * 1e6 / 10e9 / 0.01)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_weight_pair_decodes_alike_from_filled_caches(family, tmp_path):
    """The benchmark's same-weight pair in fp32, caches filled by `fill_same_caches` past the top-k (1502 tokens:
    the indexer selects 512 of them, k-pools of 4 and an incomplete tail): two decode steps give transformers'
    logits within 1e-5 of their scale. A cache written differently on either side fails here."""
    bench = load_bench()
    pair = bench.to_fp32(bench.build_same_weight_pair(family, bench.kdsa_config(quick=True), tmp_path, "eager"))
    theirs, ours = bench.fill_same_caches(pair, 1502, dtype=torch.float32)
    token = torch.tensor([[7]])
    with torch.inference_mode():
        for _ in range(2):
            reference = pair.peer(input_ids=token, cache=theirs, use_cache=True).logits[:, -1]
            logits = pair.kdsa(input_ids=token, cache=ours, use_cache=True).logits[:, -1]
            assert float((logits - reference).abs().max() / reference.abs().max()) < 1e-5
            token = reference.argmax(-1, keepdim=True)


def test_interleaved_timing_stops_when_the_ratio_is_steady(monkeypatch):
    """`time_interleaved` on a fake clock: a constant 2:1 ratio stops after two batches with the 10 % criterion met;
    a ratio that alternates between batches (1, 3, 1, ...) runs to the cap and says the criterion was not met; a
    ratio that jumps once and then holds stops when two batches agree. The steps run A B A B."""
    bench = load_bench()
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    calls = []

    def step(name, cost):
        def run():
            calls.append(name)
            clock[0] += cost(calls.count(name))  # cost of the n-th call

        return run

    _, steady = bench.time_interleaved({"a": step("a", lambda n: 1.0), "b": step("b", lambda n: 2.0)}, 1, 3, 5)
    assert steady["batches"] == 2 and steady["criterion_met"] and steady["last_change"] == 0.0
    assert steady["pair_ratios"]["b"]["median"] == 2.0 and steady["ratio_per_batch"] == [{"b": 2.0}] * 2
    assert calls[:4] == ["a", "b", "a", "b"]

    def alternating(n):
        return 1.0 if (n - 1) // 3 % 2 == 0 else 3.0  # calls 1-3 cost 1, 4-6 cost 3, 7-9 cost 1, ...

    calls.clear()
    results, steady = bench.time_interleaved({"a": step("a", lambda n: 1.0), "b": step("b", alternating)}, 0, 3, 4)
    assert steady["batches"] == 4 and not steady["criterion_met"]
    assert results["b"]["min_s"] == 1.0 and len(results["b"]["times_s"]) == 12
    calls.clear()
    jump_once = step("b", lambda n: 1.0 if n <= 3 else 2.0)
    _, steady = bench.time_interleaved({"a": step("a", lambda n: 1.0), "b": jump_once}, 0, 3, 5)
    assert steady["batches"] == 3 and steady["criterion_met"]


def test_dsa_layer_only_reports_the_percent_of_its_limit(tmp_path):
    """`--quick --dsa-layer-only`: section 1 alone. Each variant's bytes a step must read, written from the dims
    (indexer keys over the context, the selected `[c | k_pe]` rows, the layer's weights), equal what its own cache
    holds per token plus its weights, and the % of the limit is that floor over the step's median."""
    bench = load_bench()
    out = tmp_path / "dsa.json"
    # 1024 cached tokens > index_topk (512): the sparse variants read fewer latent rows than the dense one.
    bench.main(["--quick", "--dsa-layer-only", "--contexts", "256", "1024", "--threads", "1", "--repeats", "2",
                "--max-batches", "2", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert set(report) >= {"bandwidth", "dsa_layer_decode"} and "model_decode" not in report
    config = bench.kdsa_config(quick=True)
    row_bytes = 2 * (config.kv_lora_rank + config.qk_rope_head_dim)  # bf16 [c | k_pe]
    assert [entry["context"] for entry in report["dsa_layer_decode"]] == [256, 1024]
    for entry in report["dsa_layer_decode"]:
        context = entry["context"]
        selected = min(config.index_topk, context)
        variants = (("ours", selected), ("ours_compiled", selected), ("ours_dense", context), ("DeepseekV32", selected))
        for name, rows in variants:
            needed = entry[name]["bytes_needed"]
            assert needed["indexer_bytes"] == 2 * context * config.index_head_dim
            assert needed["latent_bytes"] == rows * row_bytes
            assert needed["weight_bytes"] > 0
            assert needed["total_bytes"] == needed["from_cache_total_bytes"], name
            limit = entry[name]["limit"]
            assert limit["percent_of_limit"] == pytest.approx(100 * limit["limit_s"] / entry[name]["median_s"])


def test_time_repeated_takes_batches_until_two_agree(monkeypatch):
    """`time_repeated` on a fake clock (as above), a step timed alone: batches of `repeats` until two consecutive
    batch medians agree within 10 %, the median over those two (a slow first batch, a transient, does not set it), min
    over all; one batch: the median of all."""
    bench = load_bench()
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def step_costing(*costs):
        costs = list(costs)

        def run():
            clock[0] += costs.pop(0)

        return run

    step = step_costing(9.0, 5.0, 5.0, 5.0, 1.0, 1.2, 1.0, 1.05, 1.0, 1.1)  # warm-up, then 3 batches of 3
    result = bench.time_repeated(step, warmup=1, repeats=3, max_batches=5)
    steady = result["steadiness"]
    assert steady["batches"] == 3 and steady["criterion_met"]
    assert steady["batch_medians_s"] == pytest.approx([5.0, 1.0, 1.05])
    assert result["median_s"] == pytest.approx(1.025) and result["min_s"] == 1.0 and len(result["times_s"]) == 9
    assert steady["last_change"] == pytest.approx(0.05)

    never_steady = step_costing(5.0, 1.0, 1.0, 1.0, 3.0, 3.0)  # every timed step counts
    result = bench.time_repeated(never_steady, warmup=0, repeats=2, max_batches=3)
    assert not result["steadiness"]["criterion_met"] and result["median_s"] == pytest.approx(2.0)
    one_batch = step_costing(5.0, 1.0, 2.0)  # max_batches 1 (the default): the median of all
    assert bench.time_repeated(one_batch, warmup=0, repeats=3)["median_s"] == pytest.approx(2.0)


def test_bytes_per_decode_step_formula():
    bench = load_bench()
    layers = [
        dict(kind="linear", state_bytes=1000, per_token_bytes=0),
        dict(kind="indexed", state_bytes=0, per_token_bytes=10, latent_bytes=8, indexer_bytes=2),
        dict(kind="dense", state_bytes=0, per_token_bytes=8, latent_bytes=8, indexer_bytes=0),
    ]
    needed = bench.bytes_per_decode_step(weight_bytes=500, cache_layers=layers, context=100, selected=16)
    # weights + KDA state + indexer keys over all 100 tokens + 16 selected latent rows + 100 dense latent rows
    assert needed["total_bytes"] == 500 + 1000 + 100 * 2 + 16 * 8 + 100 * 8
    dense = bench.bytes_per_decode_step(weight_bytes=500, cache_layers=layers, context=100, selected=None)
    assert dense["latent_bytes"] == 100 * 8 + 100 * 8


def test_speculative_bench_quick_run(tmp_path):
    """scripts/bench_speculative.py --quick with the shipped target, its MTP layer, its small draft and its DSpark
    draft: every method's output equals plain greedy, the statistics are consistent, and the run is recorded (date,
    machine, command) for docs/benchmarks.md (a subprocess: the script parses sys.argv)."""
    out = tmp_path / "spec.json"
    script = SCRIPT.with_name("bench_speculative.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["models"].startswith("checkpoints/kdsa-tiny (+ its MTP layer)")
    assert report["mtp_parameters"] > 0 and report["dspark_parameters"] > 0
    assert report["date"] and report["cpu_model"] and report["command"].endswith("--quick --out " + str(out))
    rows = report["rows"]
    tasks = ("copy", "recall_mid", "free", "repetitive")
    methods = ("plain", "prompt_lookup", "assisted", "mtp", "dspark", "mtp_always", "dspark_always", "mtp_lookup",
               "dspark_lookup")
    assert {(r["task"], r["method"]) for r in rows} == {(task, method) for task in tasks for method in methods}
    for row in rows:
        assert row["identical_to_plain"], row
        assert row["tokens_per_s"] > 0
        if row["method"] == "plain":
            assert row["verify_rounds"] == row["new_tokens"] and row["drafted"] == 0
        else:
            # every target forward but the prefill verifies a draft; each commits its accepted drafts plus one token
            assert row["verify_rounds"] <= row["new_tokens"] * row["prompts"]
            assert row["tokens_per_round"] == row["new_tokens"] * row["prompts"] / row["verify_rounds"]
            if row["drafted"]:
                assert 0.0 <= row["acceptance_rate"] <= 1.0
            assert row["rollback_bytes_per_pending_token"] > 0
        if row["method"].endswith("_always"):  # every round drafts but a last one with no room before the limit
            assert row["undrafted_rounds"] <= row["prompts"]


def test_verify_cost_bench_quick_run(tmp_path, capsys):
    """scripts/bench_verify_cost.py --quick: a forward over n = 1, 2, 4, 8, 16 tokens from a filled 256-token cache with
    rollback records, each cropped back; then rounds of a forward and a crop keeping n // 2 tokens (the replay). Every
    timing positive, the ratios to n = 1 consistent with the medians, a replay share in (0, 1) for n >= 2 and none for
    n = 1, and the cache grown by the kept tokens only. Timings are not compared (noisy machines)."""
    spec = importlib.util.spec_from_file_location("bench_verify_cost", SCRIPT.with_name("bench_verify_cost.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "verify.json"
    threads = torch.get_num_threads()
    report = module.main(["--quick", "--out", str(out)])
    assert torch.get_num_threads() == threads  # restored
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["environment"]["threads"] == 1 and report["contexts"] == [256]
    (entry,) = report["results"].values()
    rows = entry["rows"]
    assert [(row["context"], row["n"]) for row in report["rows"]] == [(256, n) for n in (1, 2, 4, 8, 16)]
    assert [row["verify_ms"] for row in report["rows"]] == [round(1e3 * r["verify_median_s"], 2) for r in rows.values()]
    assert list(rows) == ["1", "2", "4", "8", "16"]
    base = rows["1"]["verify_median_s"]
    for n, row in rows.items():
        assert len(row["verify_times_s"]) == report["repeats"] and min(row["verify_times_s"]) > 0
        assert row["ratio_to_one"] == pytest.approx(row["verify_median_s"] / base)
        if n == "1":
            assert "replay_s" not in row and row["ratio_to_one"] == 1.0
        else:
            assert row["replayed_tokens"] == int(n) // 2 and row["replay_median_s"] > 0
            assert 0.0 < row["replay_share_median"] < 1.0
    kept = sum(int(n) // 2 for n in rows) * report["repeats"]
    assert entry["final_context"] == 256 + kept + sum(int(n) // 2 for n in rows)  # the warm-up round kept tokens too
    assert "verify cost" in capsys.readouterr().out


def test_prefill_bench_runs_and_times_every_module_kind(tmp_path):
    """scripts/bench_prefill.py on 64 tokens (a subprocess: it wraps the module classes' forwards with timers): JSON
    with positive wall and CPU times and a timer for every module kind and KDA kernel of this checkout."""
    out = tmp_path / "prefill.json"
    script = SCRIPT.with_name("bench_prefill.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(script), "--tokens", "64", "--threads", "1", "--out", str(out)],
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tokens"] == 64 and report["wall_s"] > 0 and report["cpu_s"] > 0
    assert report["package"] == str(SCRIPT.parent.parent)
    expected = {"KDA layers", "DSA layers", "MoE", "dense MLP and shared experts", "kernel chunk_kda", "kernel l2norm"}
    assert expected <= set(report["module_wall_s"]) and all(t > 0 for t in report["module_wall_s"].values())


def test_graph_mode_bench_refuses_a_batch_below_one(capsys):
    """`--batch 0` is a usage error naming the option, not a failure deep inside the cache."""
    bench = load_bench().sibling_script("bench_graph_mode")
    assert bench.parse_args(["--batch", "3"]).batch == 3
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch", "0"])
    assert "--batch takes a number of sequences >= 1, got 0" in capsys.readouterr().err


ROUTES = ("eager_paged", "compiled_static", "aot_package")


@pytest.mark.slow
def test_graph_mode_bench_quick_run(tmp_path, capsys):
    """scripts/bench_graph_mode.py --quick (small model, context 128) with two sequences: eager and compiled whole
    decode steps and the AOTInductor package's, the compiled logits close to eager's (bf16), one graph for all steps,
    cold compile (in the run's own process, an empty inductor cache) and warm compile (a fresh process over the same
    cache)."""
    out = tmp_path / "graph.json"
    script = SCRIPT.with_name("bench_graph_mode.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(script), "--quick", "--threads", "1", "--batch", "2", "--out",
                             str(out)], env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Whole decode step, batch 2" in result.stdout
    report = json.loads(out.read_text())
    assert report["environment"]["batch"] == 2
    (row,) = report["decode"]
    assert row["context"] == 128
    assert row["eager_paged_s"] > 0 and row["eager_static_s"] > 0 and row["compiled_static_s"] > 0
    assert row["graphs_compiled"] == 1
    assert row["max_abs_logit_diff"] < 0.05  # bf16 logits of O(1) size
    # Guard evaluation skipped: the same graph on the same cache contents, so the same logits bit for bit.
    assert row["compiled_unguarded_s"] > 0 and row["unguarded_max_abs_logit_diff"] == 0
    assert len(row["times_s"]["compiled_unguarded"]) == len(row["times_s"]["compiled_static"])
    # The AOTInductor package of the step (docs/graph-mode.md §14): compiled once, timed in the same loop, its logits
    # those of the same fixed-shape step (bf16).
    assert row["aot_compile_s"] > 0 and row["aot_load_s"] > 0 and row["aot_package_s"] > 0
    assert len(row["times_s"]["aot_package"]) == len(row["times_s"]["compiled_static"])
    assert row["aot_max_abs_logit_diff"] < 0.05
    assert row["aot_speedup_min"] <= row["aot_speedup_median"] <= row["aot_speedup_max"]
    assert "AOT package ms" in result.stdout
    # Whole generate() calls from the filled caches: eager paged, generate()'s compiled step, the package.
    generate = row["generate_ms_per_token"]
    assert all(len(generate["times_ms"][name]) == generate["repeats"] > 0 for name in ROUTES)
    assert all(generate[name] > 0 for name in ROUTES) and "model.generate (128 cached" in result.stdout
    # Cold: this process's first compile in an empty inductor cache; warm: a fresh process that finds all of it there.
    cold, warm = report["compile"]["cold"], report["compile"]["warm"]
    assert cold["compile_s"] == row["first_compiled_call_s"] > 0 and warm["compile_s"] > 0
    assert cold["fx_graph_cache_misses"] > 0 and cold["fx_graph_cache_hits"] == 0
    assert warm["fx_graph_cache_hits"] > 0 and warm["fx_graph_cache_misses"] == 0
    # The compiled step is a handful of fused kernels and GEMMs instead of thousands of small operators.
    profiles = row["op_profile"]
    assert 0 < profiles["compiled_static"]["aten_calls_per_step"] < profiles["eager_static"]["aten_calls_per_step"]
    assert all(profile["top"] for profile in profiles.values())
    # scripts/bench_long_context.py's sections 5b and 5c take these rows as they are (its own smoke test skips the
    # package to save its compile): each route's fraction of the limit, and both tables printed.
    long_context = load_bench()
    long_context.add_limits(row, total_bytes=2e8, bandwidth=40.0)
    for route, seconds in (("compiled", "compiled_static_s"), ("aot", "aot_package_s")):
        assert row[f"{route}_limit"]["fraction_achieved"] == pytest.approx(2e8 / 40e9 / row[seconds])
    long_context.print_whole_step([row])
    printed = capsys.readouterr().out
    assert "5b. Whole decode step" in printed and "5c. The decode step ahead of time" in printed
    long_context.print_whole_step([{k: v for k, v in row.items() if not k.startswith("aot_")}])
    assert "5c." not in capsys.readouterr().out


@pytest.mark.slow
def test_dsa_kernel_bench_case_times_every_kernel_of_every_backend():
    """`scripts/bench_dsa_kernels.py`'s per-case measurement at a small context: the indexer, sparse attention and
    dense MLA of the torch, cpu and compiled backends, each timed and compared with the torch reference."""
    bench = load_bench().sibling_script("bench_dsa_kernels")
    with torch.inference_mode():
        rows = bench.bench_case(bench.KDSAConfig(), "decode-seq", 8192, 1, repeats=1)  # 3 dense key blocks
    assert [row["backend"] for row in rows] == ["torch", "cpu", "compiled"]
    for row in rows:
        assert min(row["indexer_ms"], row["attention_ms"], row["total_ms"], row["dense_ms"]) > 0
        assert row["recall_vs_reference"] >= 0.99
        # bf16 outputs of the same attention: within a few bf16 ulps of the reference's, exactly 0 for the reference
        assert row["dense_max_abs_diff_vs_reference"] < 0.05
    assert rows[0]["dense_max_abs_diff_vs_reference"] == 0.0


def test_cpu_kernel_bench_quick_run(tmp_path):
    """`scripts/bench_cpu_kernels.py --quick`: every case (KDA step cold and warm, FP8-held forwards, row products, MLA
    head products, routed experts eager and compiled) with both paths timed and a per-round ratio; a round count below
    one is a usage error."""
    bench = load_bench().sibling_script("bench_cpu_kernels")
    out = tmp_path / "bench_cpu_kernels.json"
    report = bench.main(["--quick", "--repeats", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == report and report["repeats"] == 2
    names = [row["name"] for row in report["results"]]
    assert names[:2] == ["kda step, cold", "kda step, warm"]
    kernels = ["kda"] * 2 + ["fp8"] * 2 + ["row"] * 2 + ["mla"] + ["experts"] * 4
    assert [row["kernel"] for row in report["results"]] == kernels
    experts = [
        f"experts 4x64x32 top2{tokens}, {mode}" for tokens in ("", " x2 tokens") for mode in ("eager", "compiled")
    ]
    assert [row["name"] for row in report["results"]][-4:] == experts
    for row in report["results"]:
        assert row["reference_ms"] > 0 and row["kernel_ms"] > 0 and len(row["ratios"]) == 2
        assert row["ratio_median"] == statistics.median(row["ratios"]) and row["ratio_min"] == min(row["ratios"])
    assert set(report["kernels_available"]) == {"kda", "fp8", "row", "mla", "experts"}
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--repeats", "0", "--out", str(out)])
