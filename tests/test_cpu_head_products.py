"""The hand-written CPU kernels of MLA's per-head products with `kv_b_proj`'s weight
(modeling_kdsa/cpu_head_products.py, docs/dsa.md §13): their results against the fp32 einsum, the strided weight views
they read, their two-thread split, the cases left to the einsums, their input checks, the compiled op, and a DSA layer's
decode step reaching them."""

import pytest
import torch
from conftest import (
    assert_avx2_builds_pass,
    assert_refused_like_every_cpu_kernel,
    count_calls,
    graph_recorder,
    graph_targets,
    needs_kernel_build,
    runs_avx512_builds,
    tiny_config,
)

from modeling_kdsa import KDSACache, KDSAForCausalLM, cpu_extension, cpu_head_products
from modeling_kdsa.cpu_head_products import head_linear, head_matmul, kernels_apply
from modeling_kdsa.kernels import CPU_KERNELS

# The `cpu` backend's per-head products: the kernels where they apply, else the torch reference's einsums.
per_head_matmul, per_head_linear = CPU_KERNELS.head_matmul, CPU_KERNELS.head_linear

pytestmark = pytest.mark.usefixtures("kernels_at_this_thread_count", "no_grad")


def kv_b_case(heads=3, nope=5, value=7, latent=37, rows=(1, 1), integers=True, seed=0):
    """`kv_b_proj.weight` viewed `[H, Dn + Dv, C]` and its two slices (strided views, as the layer takes them), query
    rows `[..., H, Dn]` and latent rows `[..., H, C]`. Integers up to 100 (exact in bf16) make every product and sum
    exact in fp32 (under 2^24), so any summation order gives the same fp32 result, and its rounding to bf16 is the
    kernels' rounding alone."""
    generator = torch.Generator().manual_seed(seed)

    def values(*shape):
        if integers:
            return torch.randint(-100, 101, shape, generator=generator).bfloat16()
        return torch.randn(shape, generator=generator).bfloat16()

    weight = values(heads * (nope + value), latent).view(heads, nope + value, latent)
    return weight[:, :nope], weight[:, nope:], values(*rows, heads, nope), values(*rows, heads, latent)


def expected(w_uk, w_uv, q, latent):
    """The fp32 einsums of the layer's fallback, rounded to bf16 once."""
    query = torch.einsum("...hn,hnk->...hk", q.float(), w_uk.float()).bfloat16()
    output = torch.einsum("...hk,hnk->...hn", latent.float(), w_uv.float()).bfloat16()
    return query, output


@needs_kernel_build
@pytest.mark.parametrize(
    "heads, nope, value, latent, rows",
    [
        (3, 5, 7, 37, (1, 1)),  # C = 2·16 + a masked tail of 5 (matmul); one step of 32 + a tail (linear)
        (16, 128, 128, 512, (1, 1)),  # the benchmark shape: whole vectors only
        (2, 4, 3, 16, (2, 1)),  # two sequences, one whole vector
        (2, 3, 5, 33, (1,)),  # a masked tail of a single value (matmul)
        (4, 17, 9, 300, (3,)),  # three rows through every loop of both kernels
        (1, 3, 2, 31, (1, 4)),  # four rows, a single head (its slices are contiguous)
        (4, 17, 9, 300, (1, 5)),  # five rows (a verification): groups of 4 and 1
        (3, 5, 7, 37, (2, 8)),  # sixteen rows: four groups of 4
        (2, 4, 3, 16, (13,)),  # groups of 4, 4, 4, 1
    ],
)
def test_kernels_equal_the_fp32_products_on_exact_inputs(heads, nope, value, latent, rows):
    w_uk, w_uv, q, out_latent = kv_b_case(heads, nope, value, latent, rows)
    assert kernels_apply(q, w_uk) and kernels_apply(out_latent, w_uv)
    query, output = head_matmul(q, w_uk), head_linear(out_latent, w_uv)
    assert query.shape == (*rows, heads, latent) and output.shape == (*rows, heads, value)
    expected_query, expected_output = expected(w_uk, w_uv, q, out_latent)
    assert torch.equal(query, expected_query) and torch.equal(output, expected_output)
    exact = torch.einsum("...hn,hnk->...hk", q.float(), w_uk.float())
    assert not torch.equal(expected_query.float(), exact)  # some sums really were rounded to bf16


@needs_kernel_build
def test_random_bf16_rows_are_within_one_rounding_of_the_fp32_products():
    assert cpu_head_products.kernel_available()  # loads the ops, whichever test of the file runs first
    w_uk, w_uv, q, out_latent = kv_b_case(8, 64, 32, 200, (2, 1), integers=False)
    results = head_matmul(q, w_uk), head_linear(out_latent, w_uv)
    for got, reference in zip(results, expected(w_uk, w_uv, q, out_latent), strict=True):
        assert ((got.float() - reference.float()).abs() <= 2**-7 * reference.float().abs() + 1e-6).all()


@needs_kernel_build
def test_a_nan_reaches_the_outputs_it_enters():
    """A NaN in a head's query or latent row makes that head's outputs NaN (not infinities or zeros), as torch's
    products do; the other heads stay finite."""
    assert cpu_head_products.kernel_available()
    w_uk, w_uv, q, out_latent = kv_b_case(heads=3)
    q[0, 0, 1, 2] = float("nan")
    out_latent[0, 0, 2, 5] = -float("nan")
    query, output = head_matmul(q, w_uk), head_linear(out_latent, w_uv)
    assert query[0, 0, 1].isnan().all() and output[0, 0, 2].isnan().all()
    assert query[0, 0, [0, 2]].isfinite().all() and output[0, 0, :2].isfinite().all()


@needs_kernel_build
def test_two_threads_each_take_a_block_of_heads(monkeypatch):
    """Over the kernels' grain (~512 KiB of weight per thread) the heads are split between two threads: the results
    stay the exact products. (That the split happens at all needs the OpenMP build: test_cpu_extension.py.)"""
    assert cpu_head_products.kernel_available()
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_extension, "MAX_THREADS", 2)
    torch.set_num_threads(2)
    try:
        w_uk, w_uv, q, out_latent = kv_b_case(16, 128, 128, 512, (2,))  # grain: 4 heads
        expected_query, expected_output = expected(w_uk, w_uv, q, out_latent)
        assert torch.equal(head_matmul(q, w_uk), expected_query)
        assert torch.equal(head_linear(out_latent, w_uv), expected_output)
    finally:
        torch.set_num_threads(threads)


@needs_kernel_build
def test_strided_rows_reach_the_kernels_as_contiguous_copies(monkeypatch):
    """The layer's query block (`q_nope[:, block]`) and latent output may be strided views: the kernels get contiguous
    copies of them and give the exact products."""
    query_calls = count_calls(monkeypatch, cpu_head_products, "head_matmul")
    output_calls = count_calls(monkeypatch, cpu_head_products, "head_linear")
    w_uk, w_uv, q, out_latent = kv_b_case(rows=(2, 3))
    q, out_latent = q[:, 1:2], out_latent[:, 1:2]  # the second of three tokens of two sequences
    assert not q.is_contiguous() and not out_latent.is_contiguous()
    expected_query, expected_output = expected(w_uk, w_uv, q, out_latent)
    assert torch.equal(per_head_matmul(q, w_uk), expected_query)
    assert torch.equal(per_head_linear(out_latent, w_uv), expected_output)
    assert len(query_calls) == len(output_calls) == 1


@needs_kernel_build
def test_the_einsums_run_where_the_kernels_do_not_apply(monkeypatch):
    """17 rows, fp32, a weight whose rows are not contiguous, a weight subclass, autograd, autocast, more threads
    than MAX_THREADS and an unavailable kernel keep the einsums, with the same results."""
    query_calls = count_calls(monkeypatch, cpu_head_products, "head_matmul")
    output_calls = count_calls(monkeypatch, cpu_head_products, "head_linear")
    w_uk, w_uv, q, out_latent = kv_b_case()

    class Subclass(torch.Tensor):
        pass

    column_major = w_uk.transpose(1, 2).contiguous().transpose(1, 2)
    padded_rows = torch.zeros(*w_uk.shape[:2], w_uk.shape[2] + 3).bfloat16()[..., : w_uk.shape[2]]
    cases = [(q.expand(17, 1, -1, -1), w_uk), (q.float(), w_uk.float()), (q, column_major), (q, padded_rows)]
    cases.append((q, w_uk.as_subclass(Subclass)))
    for x, weight in cases:
        assert not kernels_apply(x, weight)
        reference = torch.einsum("bthn,hnk->bthk", x.float(), weight.float()).to(x.dtype)
        assert torch.equal(per_head_matmul(x, weight), reference)
    assert not kernels_apply(q.float(), w_uk) and not kernels_apply(q, w_uk.float())
    assert_refused_like_every_cpu_kernel(monkeypatch, kernels_apply, (out_latent, w_uv), cpu_head_products)
    assert torch.equal(per_head_linear(out_latent, w_uv), expected(w_uk, w_uv, q, out_latent)[1])
    assert not query_calls and not output_calls


@needs_kernel_build
def test_kernels_refuse_inputs_they_cannot_read():
    """The ops read raw pointers: a wrong dtype, 17 rows, a head or width mismatch, a strided x or a weight whose
    rows are not contiguous is a ValueError, not a crash."""
    assert cpu_head_products.kernel_available()  # loads the ops' CPU kernels
    w_uk, w_uv, q, out_latent = kv_b_case()
    column_major = w_uk.transpose(1, 2).contiguous().transpose(1, 2)
    padded_rows = torch.zeros(*w_uk.shape[:2], w_uk.shape[2] + 3).bfloat16()[..., : w_uk.shape[2]]
    for op, x, weight in [
        (head_matmul, q.float(), w_uk),
        (head_matmul, q, w_uk.float()),
        (head_matmul, q.expand(17, 1, -1, -1).contiguous(), w_uk),
        (head_matmul, q[..., :2, :].contiguous(), w_uk),
        (head_matmul, q[..., :4].contiguous(), w_uk),
        (head_matmul, q.transpose(0, 2), w_uk),
        (head_matmul, q, column_major),
        (head_matmul, q, padded_rows),
        (head_matmul, q, w_uk[0]),
        (head_linear, q, w_uv),
        (head_linear, out_latent[..., :0].contiguous(), w_uv[..., :0]),
    ]:
        with pytest.raises(ValueError, match=f"{op.__name__.split('.')[-1]} takes"):
            op(x, weight)


@needs_kernel_build
def test_compiled_products_hold_the_kernels_as_ops():
    """Compiled, both products are opaque op calls with the eager results; `opcheck` checks each fake against its
    real op."""
    w_uk, w_uv, q, out_latent = kv_b_case()
    backend, graphs = graph_recorder()

    def products(q, w_uk, out_latent, w_uv):
        return per_head_matmul(q, w_uk), per_head_linear(out_latent, w_uv)

    torch._dynamo.reset()
    compiled = torch.compile(products, fullgraph=True, dynamic=False, backend=backend)
    for got, reference in zip(compiled(q, w_uk, out_latent, w_uv), expected(w_uk, w_uv, q, out_latent), strict=True):
        assert torch.equal(got, reference)
    targets = graph_targets(graphs)
    assert any("head_matmul" in t for t in targets) and any("head_linear" in t for t in targets)
    torch.library.opcheck(torch.ops.kdsa.head_matmul.default, (q, w_uk))
    torch.library.opcheck(torch.ops.kdsa.head_linear.default, (out_latent, w_uv))


@needs_kernel_build
def test_a_decode_step_reads_kv_b_proj_in_place_and_a_prefill_copies_it(monkeypatch):
    """A bf16 decode step of one sequence runs each DSA layer's two products through the kernels on views of
    `kv_b_proj.weight` (no copy); a prefill of 20 tokens takes contiguous copies and the einsums. The kernels' logits
    match those of the einsums."""
    torch.manual_seed(0)
    model = KDSAForCausalLM(tiny_config()).to(torch.bfloat16).eval()
    attention = model.model.layers[1].self_attn
    views = attention.absorbed_weights(torch.zeros(1, 1, attention.num_heads, attention.qk_nope_head_dim).bfloat16())
    copies = attention.absorbed_weights(torch.zeros(1, 20, attention.num_heads, attention.qk_nope_head_dim).bfloat16())
    weight = attention.kv_b_proj.weight
    assert all(view.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for view in views)
    assert all(copy.is_contiguous() and copy.untyped_storage().data_ptr() != weight.data_ptr() for copy in copies)

    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(cpu_head_products, "kernels_apply", lambda *args: False)
        query_calls = count_calls(monkeypatch, cpu_head_products, "head_matmul")
        output_calls = count_calls(monkeypatch, cpu_head_products, "head_linear")
        cache = KDSACache(model.config)
        model(prompt, cache=cache, use_cache=True)
        assert not query_calls and not output_calls  # the prefill's 20 rows are more than MAX_ROWS
        logits[kernels] = model(torch.tensor([[5]]), cache=cache, use_cache=True).logits
        dsa_layers = sum(layer_type == "indexed_attention" for layer_type in model.config.layer_types)
        assert len(query_calls) == len(output_calls) == (dsa_layers if kernels else 0)
    torch.testing.assert_close(logits[True], logits[False], rtol=2e-2, atol=2e-2)


@runs_avx512_builds
def test_the_avx2_builds_pass_every_test_of_this_file():
    """The AVX2 builds (what CPUs without AVX512-BF16 run) implement the same ops from another source."""
    assert_avx2_builds_pass(__file__)
