"""On a CPU without native bf16 products, bf16 products run as fp32 products of the widened operands, rounded once
(modeling_kdsa/linear_ops.py, docs/graph-mode.md §13): `linear` for more than 4 rows (`widens_to_fp32`: the result, the
fp32 call, and every case that must keep the bf16 `F.linear`), `product` for the batched products and the convolution
of a prefill (its fp32 call, and each call site reached in a tiny model's bf16 prefill). The CPU's answer is patched,
so these run on any machine."""

import pytest
import torch
import torch.nn.functional as F
from conftest import count_calls

from modeling_kdsa import linear_ops as linear_module
from modeling_kdsa.linear_ops import linear

pytestmark = pytest.mark.usefixtures("no_grad")


@pytest.fixture
def without_bf16_products(monkeypatch):
    monkeypatch.setattr(linear_module, "cpu_has_bf16_products", lambda: False)


def case(rows=8, width=100, out=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows // 2, width, generator=generator).bfloat16()
    weight = torch.randn(out, width, generator=generator).bfloat16()
    bias = torch.randn(out, generator=generator).bfloat16()
    return x, weight, bias


def test_more_than_four_rows_are_an_fp32_product_rounded_once(monkeypatch, without_bf16_products):
    """The torch reference `linear` (which the `cpu` backend runs where its row kernel does not: no AVX2, or more
    than 16 rows)."""
    x, weight, bias = case()
    calls = count_calls(monkeypatch, linear_module.F, "linear")
    got = linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 4, 12)
    assert [args[0].dtype for args in calls] == [torch.float32]  # one product, in fp32
    assert torch.equal(got, F.linear(x.float(), weight.float(), bias.float()).bfloat16())
    assert torch.equal(linear(x, weight), F.linear(x.float(), weight.float()).bfloat16())  # no bias


def test_exact_inputs_give_the_bf16_product(without_bf16_products):
    """Small integers: every product and sum is exact, so the widened product equals torch's bf16 one bit for bit."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (16, 300), generator=generator).bfloat16()
    weight = torch.randint(-3, 4, (24, 300), generator=generator).bfloat16()
    assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_the_bf16_product_stays_where_widening_does_not_apply(monkeypatch, without_bf16_products):
    """Autograd, autocast, a compile, fp32 activations, a weight subclass, 4 rows or fewer (the row kernel's, and
    `F.linear`'s where that does not apply), and a CPU with native bf16 products keep torch's product as given."""
    x, weight, bias = case()

    class Subclass(torch.Tensor):
        pass

    assert linear_module.widens_to_fp32(x, weight)
    with torch.enable_grad():
        assert not linear_module.widens_to_fp32(x, weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not linear_module.widens_to_fp32(x, weight)
    assert not linear_module.widens_to_fp32(x.float(), weight.float())
    assert not linear_module.widens_to_fp32(x, weight.as_subclass(Subclass))
    assert not linear_module.widens_to_fp32(x[:, :2], weight)  # 4 rows
    assert linear_module.widens_to_fp32(x[:, :3], weight)  # 6 rows
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not linear_module.widens_to_fp32(x, weight)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(linear_module, "cpu_has_bf16_products", lambda: True)
    assert not linear_module.widens_to_fp32(x, weight)
    calls = count_calls(monkeypatch, linear_module.F, "linear")
    linear(x, weight, bias)
    assert [args[0].dtype for args in calls] == [torch.bfloat16]


def test_four_rows_without_the_row_kernel_keep_the_bf16_f_linear(monkeypatch, without_bf16_products):
    """In the torch reference (where the row kernel does not run: no AVX2), 4 rows keep torch's bf16 product:
    widening the weight would cost more than one slow read of it; 5 rows are widened."""
    calls = count_calls(monkeypatch, linear_module.F, "linear")
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(12, 100, generator=generator).bfloat16()
    linear(torch.randn(4, 100, generator=generator).bfloat16(), weight)
    linear(torch.randn(5, 100, generator=generator).bfloat16(), weight)
    assert [args[0].dtype for args in calls] == [torch.bfloat16, torch.float32]


def test_a_product_of_bf16_operands_runs_in_fp32(monkeypatch, without_bf16_products):
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(3, 5, 40, generator=generator).bfloat16()
    b = torch.randn(3, 40, 6, generator=generator).bfloat16()
    seen = []

    def bmm(x, y):
        seen.append((x.dtype, y.dtype))
        return torch.bmm(x, y)

    got = linear_module.product(bmm, a, b)
    assert seen == [(torch.float32, torch.float32)] and got.dtype == torch.bfloat16
    assert torch.equal(got, torch.bmm(a.float(), b.float()).bfloat16())
    monkeypatch.setattr(linear_module, "cpu_has_bf16_products", lambda: True)
    assert linear_module.product(bmm, a, b).dtype == torch.bfloat16 and seen[-1] == (torch.bfloat16, torch.bfloat16)


def test_a_bf16_prefill_widens_its_attention_and_convolution_products(monkeypatch):
    """A bf16 prefill of the tiny model (KDA and DSA layers, `cpu` kernels) on a CPU without native bf16 products: the
    KDA short convolution, the indexer's and the sparse attention's batched products and the per-head absorptions go
    through `product` (and run in fp32), and the logits stay within bf16 rounding of the unwidened forward's."""
    from conftest import tiny_config

    from modeling_kdsa import KDSAForCausalLM, dsa_paged_fused, kda_ops

    torch.manual_seed(0)
    model = KDSAForCausalLM(tiny_config()).bfloat16().eval()
    ids = torch.randint(3, 128, (1, 24))
    monkeypatch.setattr(linear_module, "cpu_has_bf16_products", lambda: True)
    expected = model(input_ids=ids).logits.float()
    monkeypatch.setattr(linear_module, "cpu_has_bf16_products", lambda: False)
    modules = (linear_module, dsa_paged_fused, kda_ops)
    calls = {module: count_calls(monkeypatch, module, "product") for module in modules}
    got = model(input_ids=ids).logits.float()
    assert all(calls.values()), {module.__name__: len(c) for module, c in calls.items()}
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05 * expected.abs().max().item())
