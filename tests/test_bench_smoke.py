"""Smoke tests of the benchmark scripts. scripts/bench_long_context.py: `--quick` (contexts 256 and 512, prefill
128) runs end to end in this process and writes JSON with every section and positive numbers (about a minute on an
idle 2-core machine, most of it the cold/warm compile probes, so it is marked slow). scripts/bench_speculative.py:
`--quick` with the shipped checkpoints. Timings are never asserted (noisy machines).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_long_context.py"
MODELS = ("KDSA", "KimiLinear", "Glm5Next")


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
    load_bench().main(["--quick", "--threads", "1", "--out", str(out)])
    report = json.loads(out.read_text())

    assert report["contexts"] == [256, 512]
    assert report["environment"]["threads"] == 1
    assert report["bandwidth"]["best_gbs"] > 0
    assert set(report["peers"]["parameters"]) == set(MODELS)
    assert all(count > 0 for count in report["peers"]["parameters"].values())

    for entry in report["dsa_layer_decode"]:
        for name in ("ours", "ours_dense", "DeepseekV32"):
            result = entry[name]
            assert result["median_s"] > 0
            assert result["bytes_needed"]["total_bytes"] > 0
            assert result["limit"]["fraction_achieved"] > 0
        # Dense reads every latent row, sparse only the top-k; at 512 cached tokens top-512 is everything.
        assert entry["ours_dense"]["bytes_needed"]["total_bytes"] >= entry["ours"]["bytes_needed"]["total_bytes"]

    for entry in report["model_decode"]:
        assert set(entry["models"]) == set(MODELS)
        for result in entry["models"].values():
            assert result["median_s"] > 0 and result["tokens_per_s"] > 0
            assert result["bytes_needed"]["weight_bytes"] > 0 and result["bytes_needed"]["cache_read_bytes"] > 0

    assert report["prefill"]["context"] == 128
    for name in MODELS:
        result = report["prefill"]["models"][name]
        assert result.get("skipped") or result["median_s"] > 0, name

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
    """scripts/bench_speculative.py --quick with the shipped target and draft: every method's output equals plain
    greedy, and the acceptance statistics are consistent (a subprocess: the script parses sys.argv)."""
    out = tmp_path / "spec.json"
    script = SCRIPT.with_name("bench_speculative.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["models"] == "checkpoints/kdsa-tiny + checkpoints/kdsa-tiny-draft"
    rows = report["rows"]
    tasks, methods = ("copy", "recall_mid", "repetitive"), ("plain", "prompt_lookup", "assisted")
    assert {(r["task"], r["method"]) for r in rows} == {(task, method) for task in tasks for method in methods}
    for row in rows:
        assert row["identical_to_plain"], row
        assert row["tokens_per_s"] > 0
        if row["method"] == "plain":
            assert row["verify_rounds"] == row["new_tokens"] and row["drafted"] == 0
        else:
            assert 0.0 <= row["acceptance_rate"] <= 1.0
            assert row["rollback_bytes_per_pending_token"] > 0


@pytest.mark.slow
def test_graph_mode_bench_quick_run(tmp_path):
    """scripts/bench_graph_mode.py --quick (small model, context 128): eager and compiled whole decode steps, the
    compiled logits close to eager's (bf16), one graph for all steps, cold and warm compile in fresh processes."""
    out = tmp_path / "graph.json"
    script = SCRIPT.with_name("bench_graph_mode.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(script), "--quick", "--threads", "1", "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["decode"]
    assert row["context"] == 128
    assert row["eager_paged_s"] > 0 and row["eager_static_s"] > 0 and row["compiled_static_s"] > 0
    assert row["graphs_compiled"] == 1
    assert row["max_abs_logit_diff"] < 0.05  # bf16 logits of O(1) size
    assert report["compile"]["cold_s"] > 0 and report["compile"]["warm_s"] > 0
    # The compiled step is a handful of fused kernels and GEMMs instead of thousands of small operators.
    profiles = row["op_profile"]
    assert 0 < profiles["compiled_static"]["aten_calls_per_step"] < profiles["eager_static"]["aten_calls_per_step"]
    assert all(profile["top"] for profile in profiles.values())
