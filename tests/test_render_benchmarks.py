"""scripts/render_benchmarks.py renders benchmark JSON into docs/benchmarks.md between its markers, and the committed
docs/benchmarks.md equals a fresh render of docs/benchmarks/*.json."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("render_benchmarks", ROOT / "scripts" / "render_benchmarks.py")
render = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render)

FIXTURE = {
    "command": "python scripts/bench_speculative.py --quick",
    "date": "2026-12-06",
    "torch_threads": 1,
    "platform": "Linux-6.8-x86_64-with-glibc2.39",
    "environment": {"processor": "AMD EPYC 9B45"},
    "rows": [
        {"task": "copy", "method": "prompt lookup", "speedup": 2.6612, "identical": True},
        {"task": "recall|mid", "method": "assisted", "speedup": 0.33, "stats": {"accepted": 12}},
    ],
}


def test_renders_rows_and_metadata_from_the_json():
    text = render.render_json("bench_speculative.json", FIXTURE)
    assert text.splitlines()[0] == "### `bench_speculative.json`"
    assert "- date: 2026-12-06" in text
    assert "- machine: platform `Linux-6.8-x86_64-with-glibc2.39`, processor `AMD EPYC 9B45`" in text
    assert "- torch threads: 1" in text
    assert "- command: `python scripts/bench_speculative.py --quick`" in text
    assert "| task | method | speedup | identical | stats.accepted |" in text
    assert "| copy | prompt lookup | 2.661 | yes | – |" in text
    assert "| recall\\|mid | assisted | 0.33 | – | 12 |" in text  # a pipe inside a cell is escaped


def test_says_which_fields_are_missing_instead_of_inventing_them():
    text = render.render_json("bare.json", {"results": [{"x": 1}]})
    for field in ("date", "machine", "torch threads", "command"):
        assert f"- {field}: {render.MISSING}" in text
    assert "| x |" in text
    assert "No rows" in render.render_json("empty.json", {"threads": 2})
    with pytest.raises(ValueError, match="must hold an object"):
        render.render_json("list.json", [1, 2])


def test_metadata_one_dict_down_and_nested_row_lists():
    data = {"machine": {"threads": 2, "processor": "x86_64"}, "report": {"decode": [{"context": 4096}]}}
    text = render.render_json("nested.json", data)
    assert "- torch threads: 2" in text and "processor `x86_64`" in text
    assert "`report.decode`:" in text and "| 4096 |" in text


def test_update_replaces_only_the_text_between_the_markers():
    doc = f"# Figures\n\nhand-written history\n\n{render.BEGIN}\nstale\n{render.END}\n\ntail\n"
    new = render.update(doc, "fresh\n")
    assert new == f"# Figures\n\nhand-written history\n\n{render.BEGIN}\n\nfresh\n\n{render.END}\n\ntail\n"
    assert render.update(new, "fresh\n") == new
    for broken in ("no markers\n", f"{render.END}\n{render.BEGIN}\n", f"{render.BEGIN}\n{render.BEGIN}\n{render.END}"):
        with pytest.raises(ValueError, match="marker"):
            render.update(broken, "x\n")


def test_main_writes_the_doc_and_check_reports_a_stale_one(tmp_path):
    json_dir = tmp_path / "benchmarks"
    json_dir.mkdir()
    (json_dir / "b.json").write_text(json.dumps(FIXTURE))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"history\n{render.BEGIN}\n{render.END}\n")
    args = ["--doc", str(doc), "--json-dir", str(json_dir)]
    assert render.main([*args, "--check"]) == 1
    assert render.main(args) == 0
    assert "| copy | prompt lookup | 2.661 | yes | – |" in doc.read_text()
    assert doc.read_text().startswith("history\n")
    assert render.main([*args, "--check"]) == 0
    assert "No benchmark JSON" in render.render_section(render.json_files(tmp_path / "absent"))


def test_docs_benchmarks_md_is_up_to_date_with_its_json():
    text = render.DOC.read_text()
    fresh = render.update(text, render.render_section(render.json_files(render.JSON_DIR)))
    assert fresh == text, "docs/benchmarks.md is out of date: run .venv/bin/python scripts/render_benchmarks.py"
