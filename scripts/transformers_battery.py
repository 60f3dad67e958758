"""Run transformers' shared causal-LM test battery against KDSA (docs/testing.md §6).

    .venv/bin/python scripts/transformers_battery.py /path/to/transformers/tests [--distributed] [-- pytest arguments]

TESTS is the `tests/` folder of a transformers source tree matching the installed transformers: the battery's modules
(test_modeling_common.py, generation/test_utils.py, causal_lm_tester.py, exporters/test_export.py, ...) are imported
from it. The script copies KDSA's tester (tests/transformers_battery/modeling_kdsa_tester.py) to
TESTS/models/kdsa/test_modeling_kdsa.py, runs pytest on that one file from TESTS/.. (CPU, RUN_SLOW=1 so the export
tests run, HF_HUB_OFFLINE=1) and prints the passed / failed / skipped counts; the exit status is pytest's.

The tree needs `src/transformers` beside TESTS (test_pipeline_mixin.py and test_configuration_common.py import
transformers from there); when it is missing the script links it to the installed transformers. The battery imports
`parameterized` and `httpx`, which KDSA's venv does not carry: when they are missing they are installed with pip into
`--deps` (default TESTS/../.kdsa_battery_deps), a folder put first on PYTHONPATH for the run only.
`--distributed` adds KDSA to transformers' allowlist of multi-process tensor-parallel tests (2 gloo processes).
"""

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
TESTER = CHECKOUT / "tests" / "transformers_battery" / "modeling_kdsa_tester.py"
NEEDED_MODULES = ("parameterized", "httpx")


def _install_deps(deps: Path) -> None:
    """pip-install the battery's extra pure-Python modules into `deps` if this interpreter lacks them."""
    missing = [name for name in NEEDED_MODULES if importlib.util.find_spec(name) is None]
    if not missing or all((deps / name).exists() for name in missing):
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(deps), *missing], check=True)
    # pip --target also drops the dependencies' own copies (typing_extensions, ...): keep the venv's.
    for path in deps.glob("typing_extensions*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _place_tester(tests: Path) -> Path:
    target = tests / "models" / "kdsa" / "test_modeling_kdsa.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    for package in (tests / "models", target.parent):
        (package / "__init__.py").touch()
    shutil.copyfile(TESTER, target)
    return target


def _link_sources(root: Path) -> None:
    source = root / "src" / "transformers"
    if source.exists():
        return
    import transformers

    source.parent.mkdir(exist_ok=True)
    source.symlink_to(Path(transformers.__file__).parent)


def summary_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (`12 passed, 3 skipped, 40 subtests passed in 9.1s`)."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    if lines:
        for number, kind in re.findall(
            r"(\d+) (subtests passed|subtests failed|passed|failed|skipped|errors?)", lines[-1]
        ):
            key = {"error": "errors"}.get(kind, kind)
            counts[key] = counts.get(key, 0) + int(number)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", type=Path, help="the tests/ folder of a transformers source tree")
    parser.add_argument("--deps", type=Path, help="where missing test modules are pip-installed")
    parser.add_argument("--distributed", action="store_true", help="also run the 2-process tensor-parallel tests")
    args, pytest_args = parser.parse_known_args()  # the rest goes to pytest (`-- -k name`)
    pytest_args = [arg for arg in pytest_args if arg != "--"]

    tests = args.tests.resolve()
    if not (tests / "test_modeling_common.py").is_file() or not (tests / "causal_lm_tester.py").is_file():
        parser.error(f"{tests} holds no test_modeling_common.py / causal_lm_tester.py")
    root = tests.parent
    deps = (args.deps or root / ".kdsa_battery_deps").resolve()
    _install_deps(deps)
    _link_sources(root)
    target = _place_tester(tests)

    environment = dict(os.environ, RUN_SLOW="1", HF_HUB_OFFLINE="1")
    environment.setdefault("OMP_NUM_THREADS", "1")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(deps), environment.get("PYTHONPATH")]))
    if args.distributed:
        environment["KDSA_BATTERY_DISTRIBUTED"] = "1"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(target.relative_to(root)), "-q", "-rfEs"]
    command += ["-W", "ignore", "-o", "log_cli=false", "--tb=short", *pytest_args]
    result = subprocess.run(command, cwd=root, env=environment, capture_output=True, text=True)
    sys.stdout.write(result.stdout[-20000:])
    sys.stderr.write(result.stderr[-4000:])
    counts = summary_counts(result.stdout)
    print(
        "\ntransformers battery on KDSA: "
        + ", ".join(f"{counts.get(key, 0)} {key}" for key in ("passed", "failed", "skipped", "errors"))
        + f" ({counts.get('subtests passed', 0)} subtests passed, {counts.get('subtests failed', 0)} failed)"
    )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
