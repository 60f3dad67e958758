"""Builds and loads the hand-written C++ kernels of the decode step on x86 CPUs (docs/dsa.md §11).

Each kernel module (`cpu_indexer`, `cpu_sparse_mla`, `cpu_row_linear`, `cpu_head_products`, `cpu_expert_linear`,
`cpu_kda_recurrent`, `cpu_fp8_dequantize`) holds a C++ source that implements the CPU kernels of `torch.library` ops
whose schemas and fake implementations the module registers in Python. On first use the source is compiled with the
system C++ compiler (`$CXX`, default `g++`; the same compiler inductor needs) against the running torch's headers and
libraries (a few seconds) into `$XDG_CACHE_HOME/kdsa-kernels/`, one library per source, flags, compiler and torch
version, written atomically. Loading it registers the kernels (`TORCH_LIBRARY_IMPL`), so the dispatcher calls C++
without Python and a compiled step holds each op as one opaque call. A source is built for AVX512-BF16 or, on CPUs
without it, for AVX2 and FMA (`kernel_isa`, `load_build`; docs/graph-mode.md §13). Where a kernel cannot be built or
loaded (no compiler, no writable cache directory) this warns once and the callers keep their torch path.
"""

import hashlib
import os
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from functools import cache

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

# The kernels run on one thread. Up to this many intra-op threads they matched or beat the torch path, measured with 1
# and 2 on a 2-core machine (ad-hoc, caches evicted between calls): at 2 threads the indexer's compiled 64k layer step
# 1.03-1.05x and eager 1.26x, the eager sparse attention of one query at 64k 2.9x (3.6x at 1), a single-row linear
# 1.3-9.6x `F.linear` (2.3-8.3x at 1). With more threads the torch path is kept: its GEMMs and passes use every thread
# while a kernel would use one (not measured here). Splitting the indexer kernel over threads of its own lost at 2
# threads (0.72-0.93x in three runs): they compete with the OpenMP workers of torch's pool, which spin after each
# parallel region.
MAX_THREADS = 2

# ATen's `at::parallel_for` is OpenMP in torch's CPU builds and runs serially unless the caller is built with it (as
# inductor's C++ kernels are); the library then uses the libgomp.so.1 that torch has already loaded.
_COMMON_FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp")
# AVX512 with BF16 dot products; CPU_CAPABILITY selects ATen's vector types (at::vec) in torch's headers.
AVX512_FLAGS = (*_COMMON_FLAGS, "-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq",
                "-mavx512bf16", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512")  # fmt: skip
# AVX2 with FMA: the builds for CPUs without AVX512-BF16 (`kernel_isa`), which widen bf16 to fp32 themselves.
AVX2_FLAGS = (*_COMMON_FLAGS, "-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2")

# The start of every kernel source: the headers the kernels use and small helpers they share.
PRELUDE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = (uint32_t)bits << 16;
  float value;
  memcpy(&value, &widened, 4);
  return value;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even, as torch's conversion; NaN stays NaN
  uint32_t bits;
  memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return 0x7fc0;
  return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// 8 bf16 values widened to fp32 (a bf16 is the top half of an fp32).
inline __m256 widen_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// `vdpbf16ps` on 8 lanes: acc[i] + a[2i+1] * b[2i+1] + a[2i] * b[2i] for bf16 pairs a, b (fp32 sums of exact products).
// The AVX512-BF16 instruction where the build has it; in the AVX2 build the same two sums as FMAs of the widened
// halves, in the order of Intel's description of the instruction (odd element first; the instruction also flushes
// subnormal values to 0, the FMAs do not).
inline __m256 dot_bf16_pairs(__m256 acc, __m256i a, __m256i b) {
#ifdef __AVX512BF16__
  return _mm256_dpbf16_ps(acc, (__m256bh)a, (__m256bh)b);
#else
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  auto odd = [&](__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, high)); };
  auto even = [](__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); };
  return _mm256_fmadd_ps(even(a), even(b), _mm256_fmadd_ps(odd(a), odd(b), acc));
#endif
}

#ifdef __AVX512F__
// 16 at a time, as `float_to_bf16` rounds them; no NaN case: a NaN from arithmetic or from a widened bf16 / E4M3 value
// has its low 16 bits 0, so the rounding cannot carry out of the mantissa and it stays a NaN.
inline __m256i float_to_bf16_x16(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
}
#endif

// For the input checks' messages.
std::string describe(const at::Tensor& t) { return c10::str(t.sizes(), " ", t.scalar_type()); }

}  // namespace
"""


def compiler() -> str:
    return os.environ.get("CXX", "g++")


@cache
def cpu_has_bf16_products() -> bool:
    """The CPU has AVX512-BF16 (`vdpbf16ps`; every such CPU also has AVX512 F/BW/DQ/VL, and every CPU with AMX has
    it), so the kernels' AVX512 builds run and torch's bf16 GEMMs have native products to use."""
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


@cache
def kernel_isa() -> str | None:
    """The instruction set whose kernel builds this process uses: "avx512_bf16" where `cpu_has_bf16_products`, else
    "avx2" where ATen's own AVX2 kernels run (AVX2 and FMA), else None; every kernel has an AVX2 build.
    $KDSA_CPU_KERNELS overrides the choice for the process: "avx2" takes the AVX2 builds also on an AVX512-BF16 CPU
    (to test or compare them), "off" no kernel at all (the `cpu` backend's entries then run their torch fallbacks);
    "auto", the default, as above. It picks the build only: which kernels a model runs is its `kernel_backend`'s
    KernelSet (kernels.py; `torch` runs none of these)."""
    choice = os.environ.get("KDSA_CPU_KERNELS", "auto")
    if choice not in ("auto", "avx2", "off"):
        raise ValueError(f"KDSA_CPU_KERNELS must be 'auto', 'avx2' or 'off', got {choice!r}")
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if choice == "off" or (choice == "avx2" and not avx2):
        return None
    if choice == "auto" and cpu_has_bf16_products():
        return "avx512_bf16"
    return "avx2" if avx2 else None


@torch.compiler.assume_constant_result  # decided when a step is compiled (dynamo cannot trace get_num_threads)
def few_threads() -> bool:
    """At most MAX_THREADS intra-op threads: where the one-thread kernels are the faster path."""
    return torch.get_num_threads() <= MAX_THREADS


# While torch.export traces, the kernels step aside (an exported program may run where the `kdsa::` ops are not
# registered), except inside `kernels_in_export()`: `modeling_kdsa.aot` exports a decode step for an AOTInductor
# package that calls them through the dispatcher of a process that has imported this package (docs/graph-mode.md §14).
_KERNELS_IN_EXPORT = False


@contextmanager
def kernels_in_export():
    """Let `torch.export` trace the C++ kernels as `kdsa::` ops (the program then needs them registered to run)."""
    global _KERNELS_IN_EXPORT
    previous, _KERNELS_IN_EXPORT = _KERNELS_IN_EXPORT, True
    try:
        yield
    finally:
        _KERNELS_IN_EXPORT = previous


def kernels_traceable() -> bool:
    """Whether a kernel may enter the graph being traced: always, except under `torch.export` outside
    `kernels_in_export()`."""
    return _KERNELS_IN_EXPORT or not torch.compiler.is_exporting()


def plain_tensor(tensor: torch.Tensor) -> bool:
    """A plain tensor or parameter, no subclass (such as a quantized weight) whose data the kernels could not read as
    is. torch.export's non-strict tracing hands the model FakeTensors in place of its plain tensors."""
    return type(tensor) in (torch.Tensor, nn.Parameter, FakeTensor)


def _torch_flags() -> list[str]:
    """Compile and link against the running torch: the headers and libraries its wheel ships (where
    `torch.utils.cpp_extension` finds them), its C++ ABI; the libraries rpath'd."""
    root = os.path.dirname(torch.__file__)
    library = os.path.join(root, "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [f"-I{os.path.join(root, 'include')}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-L{library}",
            f"-Wl,-rpath,{library}", "-lc10", "-ltorch_cpu"]  # fmt: skip


def _cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kdsa-kernels")


def _warn_unavailable(name: str, what: str, compiler: str, directory: str, detail: str):
    warnings.warn(
        f"the CPU {name} kernel could not be {what} with {compiler!r} in {directory} ({detail.strip()[-300:]});"
        " that decode step keeps the torch path (set CXX to a C++20 compiler with AVX512-BF16, or XDG_CACHE_HOME to "
        "a writable directory)",
        stacklevel=5,
    )


@cache
def build(name: str, source: str, compiler: str, flags: tuple[str, ...] = AVX512_FLAGS) -> str | None:
    """The path of `source` compiled with `flags` into a shared library, built on first use and cached on disk per
    source, flags, compiler and torch version (it links against torch's C++ API); None, with one warning, when it
    cannot be built (no compiler, no writable cache directory)."""
    directory = _cache_dir()
    torch_flags = _torch_flags()
    key = [source, compiler, torch.__version__, *flags, *torch_flags]
    path = os.path.join(directory, f"{name}_{hashlib.sha256(chr(0).join(key).encode()).hexdigest()[:16]}.so")
    try:
        if not os.path.exists(path):
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as scratch:
                source_file, target = os.path.join(scratch, "kernel.cpp"), os.path.join(scratch, "kernel.so")
                with open(source_file, "w") as f:
                    f.write(source)
                command = [compiler, *flags, source_file, "-o", target, *torch_flags]
                subprocess.run(command, check=True, capture_output=True, text=True)
                os.replace(target, path)  # atomic: a concurrent process sees the whole library or none
    except (OSError, subprocess.CalledProcessError) as error:
        _warn_unavailable(name, "built", compiler, directory, getattr(error, "stderr", None) or str(error))
        return None
    return path


def has_cpu_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")


@cache
def load(name: str, source: str, op: str, compiler: str, flags: tuple[str, ...] = AVX512_FLAGS) -> bool:
    """Whether the CPU kernel of `op` (e.g. "kdsa::indexer_topk_decode") is registered: already (by another copy of
    the kernel module: the package's and a checkpoint's remote code may both be imported) or by building `source`
    with `flags` and loading it now; False, with one warning, when that fails."""
    if has_cpu_kernel(op):
        return True
    path = build(name, source, compiler, flags)
    if path is None:
        return False
    try:
        torch.ops.load_library(path)
    except OSError as error:
        _warn_unavailable(name, "loaded", compiler, os.path.dirname(path), str(error))
        return False
    return has_cpu_kernel(op)


def load_build(name: str, op: str, source: str, avx2_source: str | None = None) -> bool:
    """Whether `op`'s CPU kernel is registered, `load`ing the build of kernel `name` for this CPU (`kernel_isa`):
    `source` with AVX512_FLAGS, or `avx2_source` with AVX2_FLAGS (None: no AVX2 build); False where
    neither runs."""
    isa = kernel_isa()
    if isa == "avx512_bf16":
        build_name, build_source, flags = name, source, AVX512_FLAGS
    elif isa == "avx2" and avx2_source is not None:
        build_name, build_source, flags = f"{name}_avx2", avx2_source, AVX2_FLAGS
    else:
        return False
    # Registered already: every linear layer asks once per forward, so skip reading $CXX and the cache lookup.
    return has_cpu_kernel(op) or load(build_name, build_source, op, compiler(), flags)


def kernel_availability(name: str, op: str, source: str, avx2_source: str | None = None) -> Callable[[], bool]:
    """The `kernel_available()` of a `cpu_*.py` kernel module: whether the CPU supports `op`'s kernel and its build
    for this CPU (`kernel_isa`) is built and loaded (`load_build(name, op, source, avx2_source)`). A compiled step
    takes the answer as a constant instead of tracing a build."""

    @torch.compiler.assume_constant_result
    def kernel_available() -> bool:
        return load_build(name, op, source, avx2_source)

    return kernel_available


__all__ = [
    "AVX2_FLAGS",
    "AVX512_FLAGS",
    "MAX_THREADS",
    "PRELUDE",
    "build",
    "compiler",
    "cpu_has_bf16_products",
    "few_threads",
    "has_cpu_kernel",
    "kernel_availability",
    "kernel_isa",
    "kernels_in_export",
    "kernels_traceable",
    "load",
    "load_build",
    "plain_tensor",
]
