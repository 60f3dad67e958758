"""Shared fixtures: a tiny mixed KDA/DSA configuration that exercises every code path in well under a second."""

import os
import re
import subprocess
import sys
import sysconfig

import pytest
import torch
from transformers import CompileConfig

from modeling_kdsa import KDSAConfig, KDSAForCausalLM, cpu_extension

# Under pytest-xdist (the README's test command) every core runs a worker: one torch thread each, unless the caller
# chose a count (docs/testing.md §1).
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

# The hand-written CPU kernels (modeling_kdsa/cpu_*.py) run in an AVX512-BF16 build or an AVX2 one
# (cpu_extension.kernel_isa).
needs_kernel_build = pytest.mark.skipif(cpu_extension.kernel_isa() is None, reason="no AVX512-BF16 and no AVX2")
# For the test that reruns a file for the AVX2 builds, where this process holds the AVX512-BF16 builds.
runs_avx512_builds = pytest.mark.skipif(
    cpu_extension.kernel_isa() != "avx512_bf16", reason="this process runs the AVX2 builds already"
)


def assert_avx2_builds_pass(test_file: str) -> None:
    """`test_file`'s tests pass again in a process told to take the kernels' AVX2 builds (KDSA_CPU_KERNELS=avx2: what
    CPUs without AVX512-BF16 run; a process holds one build of each op), none of them skipped. The rerunning test
    itself is left out by name: `..._avx2_builds_...`."""
    environment = {**os.environ, "KDSA_CPU_KERNELS": "avx2"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "not avx2_builds"]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=os.path.dirname(test_file))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary


# The checkout; the venv may live inside it (`.venv/`), so "loaded from the checkout" means from here but outside it.
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SITE_PACKAGES = list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
_WITHOUT_THE_PACKAGE_HEAD = """
import importlib.util, sys
sys.path.extend({site_packages!r})
for _name in ("modeling_kdsa", "quantization", "parallel", "aot", "eval"):
    assert importlib.util.find_spec(_name) is None, f"{{_name}} is importable: " + str(importlib.util.find_spec(_name))
"""
_WITHOUT_THE_PACKAGE_TAIL = """
_leaked = sorted(
    f"{{_key}}: {{_module.__file__}}" for _key, _module in list(sys.modules.items())
    if (getattr(_module, "__file__", None) or "").startswith({checkout!r} + "/")
    and not any(_module.__file__.startswith(_folder + "/") for _folder in {site_packages!r})
)
assert not _leaked and "modeling_kdsa" not in sys.modules, "loaded from the checkout: " + ", ".join(_leaked)
"""


def run_without_the_package(script: str, cwd, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """Run `script` in a fresh Python that has transformers, torch and the rest of this venv but cannot import this
    package (`modeling_kdsa` and its subpackages): what a Hub user with `trust_remote_code=True` has.

    How the package is hidden: the child is `python -I -S`. `-S` skips the `site` module, so no `.pth` file of the
    venv runs, among them `__editable__.kdsa-*.pth`, whose finder maps `modeling_kdsa` (and `modeling_kdsa.eval`, ...)
    to this checkout; `-I` ignores `PYTHONPATH` and the other `PYTHON*` variables and keeps the working directory off
    `sys.path`. The script then appends the venv's site-packages folders (`sysconfig` purelib / platlib) to
    `sys.path` itself: plain folders, their `.pth` files unread, so third-party packages import and the editable
    finder stays out. Give a `cwd` outside the checkout. Two checks guard the hiding: before the script,
    `importlib.util.find_spec` finds none of `modeling_kdsa`, `quantization`, `parallel`, `aot`, `eval`; after it,
    no module in `sys.modules` was loaded from a file of the checkout outside the venv (remote code runs from the
    copies transformers makes under `HF_MODULES_CACHE`). `env` adds variables. HF_HUB_OFFLINE=1 is set, and
    OMP_NUM_THREADS is this process's `torch.get_num_threads()`: CPU reductions split by thread count, so a child
    on other threads would not reproduce this process's logits bit for bit."""
    assert not os.path.abspath(cwd).startswith(CHECKOUT + "/"), cwd
    program = (
        _WITHOUT_THE_PACKAGE_HEAD.format(site_packages=_SITE_PACKAGES)
        + script
        + _WITHOUT_THE_PACKAGE_TAIL.format(checkout=CHECKOUT, site_packages=_SITE_PACKAGES)
    )
    threads = str(torch.get_num_threads())
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads}
    environment.update({k: str(v) for k, v in env.items()})
    command = [sys.executable, "-I", "-S", "-c", program]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def left_padded_batch(lengths: list[int], vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of `lengths` tokens (ids from 3), left-padded to the longest with 0: `(ids, mask)` `[B, S]`."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


@torch.no_grad()
def verify_and_steps_logits(model, prompt: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits `[B, n, V]` of one forward over `new` `[B, n]` from a cache filled with `prompt` (a verification),
    and those of n one-token steps from another such cache."""
    cache = model(prompt, use_cache=True).cache
    steps = [model(new[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1] for t in range(new.shape[1])]
    cache = model(prompt, use_cache=True).cache
    return model(new, cache=cache, use_cache=True, logits_to_keep=new.shape[1]).logits, torch.stack(steps, dim=1)


@pytest.fixture(scope="module")
def one_thread():
    """The tiny models have nothing to gain from intra-op threads, and on a shared 2-core machine OpenMP threads
    contending with other jobs make them 10-20x slower: one thread for a module (`pytestmark`), restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernels_at_this_thread_count(monkeypatch):
    """The CPU kernels apply up to `cpu_extension.MAX_THREADS` intra-op threads; let them apply at whatever thread
    count this machine runs the tests with."""
    monkeypatch.setattr(cpu_extension, "MAX_THREADS", max(cpu_extension.MAX_THREADS, torch.get_num_threads()))


def assert_refused_like_every_cpu_kernel(monkeypatch, applies, args: tuple, kernel_module) -> None:
    """What each CPU kernel's `applies(*args)` check must refuse besides its own shapes and dtypes: autograd,
    autocast, more intra-op threads than `cpu_extension.MAX_THREADS`, and the kernel unavailable
    (`kernel_module.kernel_available`, left patched to False). `args` is a case the kernel takes otherwise."""
    assert applies(*args)
    with torch.enable_grad():
        assert not applies(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not applies(*args)
    monkeypatch.setattr(cpu_extension, "MAX_THREADS", torch.get_num_threads() - 1)
    assert not applies(*args)
    monkeypatch.setattr(cpu_extension, "MAX_THREADS", torch.get_num_threads())
    assert applies(*args)
    monkeypatch.setattr(kernel_module, "kernel_available", lambda: False)
    assert not applies(*args)


@pytest.fixture
def no_grad():
    """The test body runs under `torch.no_grad()` (inference, where the CPU kernels apply)."""
    with torch.no_grad():
        yield


def cpu_compile_config(backend="inductor", **overrides) -> CompileConfig:
    """What generate() needs to compile its decode step on CPU: `_compile_all_devices` (a class attribute, not an init
    argument)."""
    config = CompileConfig(fullgraph=True, mode="default", backend=backend, **overrides)
    config._compile_all_devices = True
    return config


def graph_recorder() -> tuple:
    """A `torch.compile` backend that runs each graph dynamo captures as it is and keeps it: `(backend, graphs)`."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return backend, graphs


def graph_targets(graphs: list) -> list[str]:
    """The targets of every node of the recorded graphs (ops, functions), as strings."""
    return [str(node.target) for graph in graphs for node in graph.graph.nodes]


def count_calls(monkeypatch, module, name: str) -> list:
    """Replace `module.name` with a wrapper that records each call and runs the original; returns the record (one entry
    per call). For checking that a caller reaches a kernel."""
    calls, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(args) or original(*args))
    return calls


def tiny_config(**overrides) -> KDSAConfig:
    """4 layers KDA, DSA, KDA, DSA; index_topk 8 so that prompts longer than 8 tokens are really sparse;
    AttnRes blocks of 2 sublayers so that block boundaries fall inside and between layers."""
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        linear_num_heads=2,
        linear_head_dim=16,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        attn_res_block_size=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return KDSAConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> KDSAForCausalLM:
    torch.manual_seed(seed)
    model = KDSAForCausalLM(tiny_config(**overrides)).eval()
    # Zero-initialised AttnRes queries make every depth softmax uniform; randomise them so tests see real routing.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_res.query"):
                param.normal_(0.0, 0.5)
    return model


def store_kernels(store):
    """The KernelSet a layer would read `store` with (its backend's, kernels.py): the paged-read functions of dsa.py
    take it with the store (docs/dsa.md §14)."""
    from modeling_kdsa.kernels import kernel_set

    return kernel_set(store.kernel_backend, store.device)


@pytest.fixture(autouse=True)
def _seed_global_rng():
    """Every test starts from the same global RNG state, whatever ran before it (or in which order): a test that
    draws from `torch.randn` without a generator is then reproducible instead of seeing fresh data on every run."""
    torch.manual_seed(0)


@pytest.fixture
def model() -> KDSAForCausalLM:
    return tiny_model()
