"""Smoke test of scripts/device_check.py: its CPU-side self-check (`--dry-run`) runs end to end for the `torch`
backend (with the compiled generate of item 6) and for the `npu` backend over the fake torch_npu
(tests/fake_torch_npu.py), passes its own bounds and writes every section. No device here; timings are never
asserted."""

import importlib.util
import json
from pathlib import Path

import fake_torch_npu
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["torch", "npu"])
def test_dry_run_passes_and_writes_every_section(backend, tmp_path, monkeypatch):
    if backend == "npu":
        fake_torch_npu.install(monkeypatch, available=True)
    out = tmp_path / "device_check.json"
    graph_mode = [] if backend == "torch" else ["--skip-graph-mode"]  # backend-independent: checked once
    assert load_script().main(["--dry-run", "--backends", backend, *graph_mode, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["dry_run"]
    assert [row["backend"] for row in report["kernels"]] == [backend, backend]
    assert all(row["indexer_recall"] >= 0.98 for row in report["kernels"] + report["kpool"])
    assert [row["case"].split()[1] for row in report["kpool"]] == ["prefill", "decode"]
    assert report["generate"][0]["equal_to_torch_on_device"]
    assert [row["context"] for row in report["decode_timing"]] == [512, 2048]
    if backend == "npu":
        assert {"npu_lightning_indexer", "npu_sparse_flash_attention"} <= set(fake_torch_npu.calls)
    if backend == "torch":
        [graph_mode] = report["graph_mode"]
        assert graph_mode["mode"] == "default" and graph_mode["equal_to_eager"] and graph_mode["new_tokens"] == 8
        assert graph_mode["graphs_compiled"] >= 1 and graph_mode["ok"]
    else:
        assert report["graph_mode"] == []


def test_graph_mode_verdict():
    """Item 6 fails on tokens that differ from eager's, and under CUDA graphs on any graph inductor skipped."""
    passed = load_script().graph_mode_passed
    assert passed(True, "default", 0) and passed(True, "reduce-overhead", 0)
    assert not passed(False, "default", 0) and not passed(False, "reduce-overhead", 0)
    assert not passed(True, "reduce-overhead", 1)


@pytest.mark.parametrize(("check", "section"), [("check_kpool", "kpool"), ("time_decode", "decode_timing")])
def test_a_check_that_raises_is_a_failed_row_and_the_run_goes_on(check, section, tmp_path, monkeypatch, capsys):
    """One check raising (a broken kernel on the device) gives a failed row with its error and exit status 1 (also
    for the timing section, which has no bound of its own), and every other check still runs and reports."""
    script = load_script()

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(script, check, broken)
    out = tmp_path / "device_check.json"
    assert script.main(["--dry-run", "--backends", "torch", "--skip-graph-mode", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report[section] == [
        {"backend": "torch", "section": section, "error": "RuntimeError: kernel exploded", "ok": False}
    ]
    others = [row for name in ("kernels", "kpool", "generate", "kda") if name != section for row in report[name]]
    assert report["kernels"] and all(row["ok"] for row in others)
    printed = capsys.readouterr().out
    assert f"ERROR in {section} (torch): RuntimeError: kernel exploded" in printed
    assert printed.rstrip().endswith("FAIL")


def test_a_run_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
    """The JSON is written after every check: a run stopped midway (here the timing section interrupted, as a device
    lease's time limit would) leaves the checks before it on disk."""
    script = load_script()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "time_decode", interrupted)
    out = tmp_path / "device_check.json"
    with pytest.raises(KeyboardInterrupt):
        script.main(["--dry-run", "--backends", "torch", "--skip-graph-mode", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["kernels"] and report["kpool"] and report["generate"][0]["ok"]
    assert report["decode_timing"] == []
