"""Render the benchmark JSON files kept in docs/benchmarks/ into docs/benchmarks.md.

Each `docs/benchmarks/*.json` (a benchmark script's `--out` file, copied there by hand when its figures are worth
keeping) becomes one subsection: the date, the machine, the torch thread count and the command, read from the JSON,
then one table per list of rows in it. A field the JSON does not hold is said to be missing, never guessed.

The rendered text replaces what lies between the two markers of docs/benchmarks.md, so the hand-written history
above them stays as it is:

    .venv/bin/python scripts/render_benchmarks.py            # rewrite docs/benchmarks.md
    .venv/bin/python scripts/render_benchmarks.py --check    # exit 1 when the file is not up to date
"""

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DOC = REPO_ROOT / "docs" / "benchmarks.md"
JSON_DIR = REPO_ROOT / "docs" / "benchmarks"
BEGIN = "<!-- rendered by scripts/render_benchmarks.py: do not edit -->"
END = "<!-- end rendered -->"

# Where the benchmark scripts keep their run's metadata: at the top level or in one of these dicts.
META_DICTS = ("environment", "machine")
DATE_KEYS = ("date", "timestamp", "started_at", "run_date")
MACHINE_KEYS = ("cpu_model", "cpu", "processor", "platform", "machine", "cpu_count")
THREAD_KEYS = ("torch_threads", "threads")
COMMAND_KEYS = ("command", "argv")
MISSING = "not recorded in the JSON"


def _meta_sources(data: dict) -> list[dict]:
    return [data] + [data[k] for k in META_DICTS if isinstance(data.get(k), dict)]


def _first(data: dict, keys: tuple[str, ...]):
    for source in _meta_sources(data):
        for key in keys:
            if source.get(key) not in (None, ""):
                return source[key]
    return None


def _machine(data: dict) -> str:
    parts, seen = [], set()
    for source in _meta_sources(data):
        for key in MACHINE_KEYS:
            if key not in seen and source.get(key) not in (None, ""):
                seen.add(key)
                parts.append(f"{key} `{source[key]}`")
    return ", ".join(parts) if parts else MISSING


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        text = json.dumps(value)
        return text if len(text) <= 60 else f"[{len(value)} values]"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _flatten(row: dict, prefix: str = "") -> dict:
    """Scalar fields of a row, nested dicts one level per dot (`a.b`); lists are kept as cells."""
    flat = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _table(rows: list[dict]) -> list[str]:
    flat = [_flatten(row) for row in rows]
    columns: list[str] = []
    for row in flat:
        columns += [key for key in row if key not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in flat]
    return lines


def _row_lists(data: dict) -> list[tuple[str, list[dict]]]:
    """Every list of dicts in the JSON (top level, or one dict down), in file order: the benchmark's rows."""
    found = []
    for key, value in data.items():
        if key in META_DICTS:
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            found.append((key, value))
        elif isinstance(value, dict):
            found += [(f"{key}.{k}", v) for k, v in value.items()
                      if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]  # fmt: skip
    return found


def render_json(name: str, data: dict) -> str:
    """One benchmark JSON as markdown: a heading, its date / machine / threads / command, a table per row list."""
    if not isinstance(data, dict):
        raise ValueError(f"{name}: a benchmark JSON must hold an object, got {type(data).__name__}")
    date, threads, command = _first(data, DATE_KEYS), _first(data, THREAD_KEYS), _first(data, COMMAND_KEYS)
    if isinstance(command, list):
        command = " ".join(map(str, command))
    lines = [
        f"### `{name}`",
        "",
        f"- date: {date if date is not None else MISSING}",
        f"- machine: {_machine(data)}",
        f"- torch threads: {threads if threads is not None else MISSING}",
        f"- command: {f'`{command}`' if command is not None else MISSING}",
    ]
    row_lists = _row_lists(data)
    if not row_lists:
        lines += ["", "No rows (no list of objects) in this JSON."]
    for key, rows in row_lists:
        lines += ["", f"`{key}`:", "", *_table(rows)]
    return "\n".join(lines) + "\n"


def render_section(paths: list[Path]) -> str:
    """The text that goes between the markers, for these JSON files (in the order given)."""
    if not paths:
        return "No benchmark JSON in `docs/benchmarks/` yet.\n"
    return "\n".join(render_json(path.name, json.loads(path.read_text())) for path in paths)


def update(doc_text: str, section: str) -> str:
    """`doc_text` with everything between the markers replaced by `section`; the rest untouched."""
    if doc_text.count(BEGIN) != 1 or doc_text.count(END) != 1 or doc_text.index(BEGIN) > doc_text.index(END):
        raise ValueError(f"the document must hold the marker lines once each, in order: {BEGIN!r} ... {END!r}")
    head, rest = doc_text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n\n{section}\n{END}{tail}"


def json_files(json_dir: Path) -> list[Path]:
    return sorted(json_dir.glob("*.json")) if json_dir.is_dir() else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc", type=Path, default=DOC, help="the markdown file to update (docs/benchmarks.md)")
    parser.add_argument("--json-dir", type=Path, default=JSON_DIR, help="folder of benchmark JSON (docs/benchmarks)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when the file is out of date")
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    rendered = update(text, render_section(json_files(args.json_dir)))
    if args.check:
        if rendered != text:
            print(f"{args.doc} is out of date: run scripts/render_benchmarks.py", file=sys.stderr)
            return 1
        return 0
    if rendered != text:
        args.doc.write_text(rendered)
        print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
