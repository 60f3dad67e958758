"""Building and loading the hand-written CPU kernels (modeling_kdsa/cpu_extension.py): which build a CPU takes, a fresh
machine's first build, a failed build, an unwritable cache directory, and a kernel another copy of the module already
registered."""

import warnings

import pytest
import torch
from conftest import needs_kernel_build

from modeling_kdsa import cpu_extension, cpu_indexer

SOURCE = cpu_indexer._SOURCE  # a real kernel source


@needs_kernel_build
def test_a_fresh_cache_directory_gets_the_library_built(tmp_path, monkeypatch):
    """What a new machine does on its first decode step: create the cache directory and build (`__wrapped__` skips
    the per-process cache of `build`)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh"))
    path = cpu_extension.build.__wrapped__("indexer_topk_decode", SOURCE, cpu_extension.compiler())
    assert path is not None and path.startswith(str(tmp_path / "fresh" / "kdsa-kernels"))
    assert len(list((tmp_path / "fresh" / "kdsa-kernels").glob("indexer_topk_decode_*.so"))) == 1
    assert not [p for p in (tmp_path / "fresh" / "kdsa-kernels").iterdir() if p.is_dir()]  # the scratch folder is gone


def test_a_failed_build_warns_once_and_leaves_the_torch_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = "/bin/false"
    with pytest.warns(UserWarning, match="could not be built with '/bin/false'"):
        assert cpu_extension.build("indexer_topk_decode", SOURCE, compiler) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_extension.build("indexer_topk_decode", SOURCE, compiler) is None  # cached: no second warning
    assert not any(tmp_path.rglob("*.so"))


def test_an_unwritable_cache_directory_warns_instead_of_failing(tmp_path, monkeypatch):
    """The first decode step builds the kernel; a cache directory that cannot be created must not break it."""
    (tmp_path / "not-a-directory").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-directory"))
    with pytest.warns(UserWarning, match="not-a-directory/kdsa-kernels"):  # the real compiler: only the directory fails
        assert cpu_extension.build.__wrapped__("indexer_topk_decode", SOURCE, cpu_extension.compiler()) is None


@needs_kernel_build
def test_a_kernel_already_registered_is_not_built_again(tmp_path, monkeypatch):
    """The package's and a checkpoint's copy of a kernel module may both be imported: the second finds the op's CPU
    kernel registered and neither builds nor loads (here: a compiler that would fail, a fresh cache directory)."""
    assert cpu_indexer.kernel_available()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_extension.load.__wrapped__("indexer_topk_decode", SOURCE, "kdsa::indexer_topk_decode", "/bin/false")
    assert not any(tmp_path.iterdir())


@needs_kernel_build
def test_a_registered_kernel_is_answered_without_the_build_machinery(monkeypatch):
    """Every linear layer asks `kernel_available()` each forward: once the kernel is registered the answer must not
    read the environment ($CXX) or go through `load`'s cache (here both would raise)."""
    assert cpu_indexer.kernel_available()

    def forbidden(*args):
        raise AssertionError("the build machinery ran for a registered kernel")

    monkeypatch.setattr(cpu_extension, "compiler", forbidden)
    monkeypatch.setattr(cpu_extension, "load", forbidden)
    assert cpu_indexer.kernel_available()


@needs_kernel_build
@pytest.mark.parametrize(("isa", "avx2_source"), [(None, SOURCE), ("avx2", None)], ids=["off", "no-avx2-build"])
def test_no_build_for_this_cpu_means_no_kernel_even_if_registered(isa, avx2_source, monkeypatch):
    """`KDSA_CPU_KERNELS=off` (no ISA), or an AVX2 CPU and a kernel without an AVX2 build: the torch path, even where
    the op's kernel is registered in the process already."""
    assert cpu_indexer.kernel_available()
    monkeypatch.setattr(cpu_extension, "kernel_isa", lambda: isa)
    assert not cpu_extension.load_build("indexer_topk_decode", "kdsa::indexer_topk_decode", SOURCE, avx2_source)


@pytest.mark.parametrize("flags", [cpu_extension.AVX512_FLAGS, cpu_extension.AVX2_FLAGS], ids=["avx512", "avx2"])
def test_kernels_are_compiled_with_openmp(tmp_path, monkeypatch, flags):
    """The row kernel splits a weight over two threads with ATen's `at::parallel_for`, which runs serially unless the
    caller is compiled with OpenMP (`_OPENMP` defined): a source that refuses to compile without it builds, with
    either build's flags. (Compiling needs no such CPU, only the compiler.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probe = '#ifndef _OPENMP\n#error "built without OpenMP: at::parallel_for would run serially"\n#endif\n'
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed build warns
        assert cpu_extension.build.__wrapped__("openmp_probe", probe, cpu_extension.compiler(), flags) is not None


@pytest.mark.parametrize(
    "choice, capability, avx512_bf16, expected",
    [
        ("auto", "AVX512", True, "avx512_bf16"),
        ("auto", "AVX512", False, "avx2"),  # AVX512 without BF16 (e.g. Skylake-SP): the AVX2 build
        ("auto", "AVX2", False, "avx2"),
        ("auto", "DEFAULT", False, None),
        ("avx2", "AVX512", True, "avx2"),
        ("avx2", "DEFAULT", False, None),
        ("off", "AVX512", True, None),
    ],
)
def test_the_build_follows_the_cpu_and_kdsa_cpu_kernels(monkeypatch, choice, capability, avx512_bf16, expected):
    """`kernel_isa` (`__wrapped__`: without its per-process cache): AVX512-BF16 builds where the CPU has it, the AVX2
    build where ATen runs AVX2 kernels, none elsewhere; $KDSA_CPU_KERNELS narrows that choice."""
    monkeypatch.setenv("KDSA_CPU_KERNELS", choice)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu_extension, "cpu_has_bf16_products", lambda: avx512_bf16)
    assert cpu_extension.kernel_isa.__wrapped__() == expected


def test_an_unknown_kdsa_cpu_kernels_value_is_refused(monkeypatch):
    monkeypatch.setenv("KDSA_CPU_KERNELS", "avx512")
    with pytest.raises(ValueError, match="KDSA_CPU_KERNELS must be 'auto', 'avx2' or 'off', got 'avx512'"):
        cpu_extension.kernel_isa.__wrapped__()
