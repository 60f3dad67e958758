"""Tests for the DSA layer (modeling_kdsa/dsa.py), its kernels (dsa_ops.py) and rotary helpers (rotary.py).

Oracles: transformers' DeepseekV32Attention / DeepseekV32Indexer (written by others), and the dense causal MLA
reference in MHA form (docs/dsa.md §5: context <= index_topk must equal dense MLA).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_dsv32
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config

from modeling_kdsa import dsa_ops
from modeling_kdsa.cache import KDSACache
from modeling_kdsa.configuration_kdsa import KDSAConfig
from modeling_kdsa.dsa import KDSASparseAttention
from modeling_kdsa.rotary import KDSARotaryEmbedding, apply_rotary_half, apply_rotary_interleaved

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def tiny_config(**overrides) -> KDSAConfig:
    fields = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=1,
        layer_types=["indexed_attention"],
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=16,
        max_position_embeddings=512,
    )
    fields.update(overrides)
    return KDSAConfig(**fields)


def make_layer(config: KDSAConfig, seed: int = 0, dtype=torch.float32) -> KDSASparseAttention:
    """A layer with random weights of O(1) attention logits (the model's `_init_weights` is not used here)."""
    torch.manual_seed(seed)
    layer = KDSASparseAttention(config, layer_idx=0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("k_norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("k_norm.bias"):
                param.uniform_(-0.5, 0.5)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    return layer.to(dtype).eval()


def rope_for(config: KDSAConfig, hidden: torch.Tensor, position_ids: torch.Tensor):
    if config.qk_rope_head_dim == 0:
        return None
    return KDSARotaryEmbedding(config)(hidden, position_ids)


def positions(batch: int, start: int, length: int) -> torch.Tensor:
    return torch.arange(start, start + length).expand(batch, -1)


def dense_mla_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_weight: torch.Tensor,
    softmax_scale: float,
    query_start: int = 0,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal MLA in MHA form, the oracle of these tests: every visible key, heads up-projected with `kv_b_proj`.

    q_nope: `[B, T, H, Dn]`; q_pe: `[B, T, H, R]`; latent: `[B, S, C]`; k_pe: `[B, S, R]`; kv_b_weight:
    `[H * (Dn + Dv), C]`; queries sit at positions `query_start + i`; key_padding_mask `[B, S]` or None.
    Returns `[B, T, H, Dv]` in `q_nope`'s dtype (fp32 math); rows with no visible key give 0.
    """
    batch, num_queries, num_heads, nope_dim = q_nope.shape
    num_keys = latent.shape[1]
    kv = torch.matmul(latent.float(), kv_b_weight.float().t()).view(batch, num_keys, num_heads, -1)
    k_nope, value = kv[..., :nope_dim], kv[..., nope_dim:]
    scores = torch.einsum("bthd,bshd->bhts", q_nope.float(), k_nope)
    scores = scores + torch.einsum("bthr,bsr->bhts", q_pe.float(), k_pe.float())
    # Built independently of `visible_keys_mask`, so that a bug there cannot hide in the comparison.
    causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=latent.device).tril(diagonal=query_start)
    visible = causal[None] if key_padding_mask is None else causal[None] & key_padding_mask.bool()[:, None, :]
    scores = (scores * softmax_scale).masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: NaN -> 0
    return torch.einsum("bhts,bshv->bthv", probs, value).to(q_nope.dtype)


def dense_forward(layer: KDSASparseAttention, hidden, position_embeddings, attention_mask=None) -> torch.Tensor:
    """Dense causal MLA (MHA form via kv_b_proj) with the layer's own projections and o_proj."""
    q_nope, q_pe, _ = layer.project_queries(hidden, position_embeddings)
    latent, k_pe = layer.project_latent(hidden, position_embeddings)
    out = dense_mla_reference(
        q_nope, q_pe, latent, k_pe, layer.kv_b_proj.weight, layer.softmax_scale, 0, attention_mask
    )
    return layer.o_proj(out.flatten(2))


def our_topk(layer: KDSASparseAttention, hidden, position_embeddings) -> torch.Tensor:
    """Top-k indices of the whole prompt (no cache), as the layer computes them."""
    _, _, query_input = layer.project_queries(hidden, position_embeddings)
    q_index, weights, k_index = layer.indexer(hidden, query_input, position_embeddings)
    return dsa_ops.indexer_topk(q_index, weights, k_index, layer.index_topk, 0)


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


# ---------------------------------------------------------------------------------------------------------------
# Rotary helpers


def test_rotary_layouts_match_transformers():
    config = tiny_config(rope_parameters=YARN)
    hf_config = hf_config_for(config)
    x = torch.randn(2, 5, 3, config.qk_rope_head_dim)
    pos = positions(2, 3, 5)
    cos, sin = KDSARotaryEmbedding(config)(x, pos)
    hf_cos, hf_sin = hf_dsv32.DeepseekV32RotaryEmbedding(hf_config)(x, pos)
    # Same formula, same fp32 ops: identical up to a few ulps.
    torch.testing.assert_close(cos, hf_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=0, atol=1e-6)

    half, _ = hf_dsv32.apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=2)
    # Same element-wise products: exact.
    torch.testing.assert_close(apply_rotary_half(x, cos[:, :, None], sin[:, :, None]), half, rtol=0, atol=0)

    # transformers writes the rotated DeepSeek pairs de-interleaved (evens then odds); we keep them in place.
    interleaved, _ = hf_dsv32.apply_rotary_pos_emb_interleave(x, x, cos, sin, unsqueeze_dim=2)
    ours = apply_rotary_interleaved(x, cos[:, :, None], sin[:, :, None])
    torch.testing.assert_close(torch.cat((ours[..., 0::2], ours[..., 1::2]), -1), interleaved, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# 1. Parity with transformers' DeepseekV32Attention


def hf_config_for(config: KDSAConfig) -> DeepseekV32Config:
    return DeepseekV32Config(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        index_n_heads=config.index_n_heads,
        index_head_dim=config.index_head_dim,
        index_topk=config.index_topk,
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        num_hidden_layers=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        vocab_size=32,
    )


def hf_attention_from(layer: KDSASparseAttention, config: KDSAConfig):
    hf_config = hf_config_for(config)
    hf_config._attn_implementation = "eager"
    hf_layer = hf_dsv32.DeepseekV32Attention(hf_config, layer_idx=0).eval()
    # Parameter names are DeepSeek's on both sides (k_norm is a LayerNorm with weight and bias on both).
    missing, unexpected = hf_layer.load_state_dict(layer.state_dict(), strict=True)
    assert not missing and not unexpected
    return hf_layer


@pytest.mark.parametrize("rope_parameters", [None, YARN], ids=["default-rope", "yarn"])
@pytest.mark.parametrize("seq_len", [12, 48], ids=["context<=topk", "context>topk"])
def test_matches_transformers_deepseek_v32(rope_parameters, seq_len):
    config = tiny_config(rope_parameters=rope_parameters)
    layer = make_layer(config)
    hf_layer = hf_attention_from(layer, config)
    assert layer.softmax_scale == pytest.approx(hf_layer.scaling, rel=1e-12)

    torch.manual_seed(1)
    batch = 2
    hidden = torch.randn(batch, seq_len, config.hidden_size)
    position_embeddings = rope_for(config, hidden, positions(batch, 0, seq_len))
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    additive_mask = torch.zeros(batch, 1, seq_len, seq_len).masked_fill(~causal, torch.finfo(torch.float32).min)

    with torch.no_grad():
        ours = layer(hidden, position_embeddings)
        query_input = hf_layer.q_a_layernorm(hf_layer.q_a_proj(hidden))
        theirs_idx = hf_layer.indexer(hidden, query_input, position_embeddings, additive_mask[:, 0], None)
        theirs, _ = hf_layer(hidden, position_embeddings, additive_mask)
        our_idx = our_topk(layer, hidden, position_embeddings)

        # Our indexer logits (formula checked in test_indexer_scores_formula), to tell near-ties from differences.
        q_index, weights, k_index = layer.indexer(hidden, query_input, position_embeddings)
        visible = dsa_ops.visible_keys_mask(0, seq_len, seq_len, None, hidden.device)
        scores = dsa_ops.indexer_scores(q_index, weights, k_index, visible)

    # Compare index sets per query row, restricted to visible keys (transformers may also pick masked future keys
    # for early rows; its attention mask removes them again). A row is unambiguous when its k-th and (k+1)-th
    # visible scores differ by more than fp32 noise; only those rows are compared, and most rows must qualify.
    k = min(config.index_topk, seq_len)
    sorted_scores = scores.sort(dim=-1, descending=True).values
    comparable = torch.ones(batch, seq_len, dtype=torch.bool)
    if k < seq_len:
        kth, next_ = sorted_scores[..., k - 1], sorted_scores[..., k]
        comparable = (kth - next_ > 1e-5) | torch.isinf(next_)
    assert comparable.float().mean() > 0.9
    for b in range(batch):
        for t in range(seq_len):
            if not comparable[b, t]:
                continue
            ours_set = {i for i in our_idx[b, t].tolist() if i >= 0}
            theirs_set = {i for i in theirs_idx[b, t].tolist() if i <= t}
            assert ours_set == theirs_set, (b, t)
            assert len(ours_set) == min(t + 1, config.index_topk)

    # fp32 on both sides, same math in a different association order (absorbed vs MHA form): ~1e-7 relative.
    rows = comparable[..., None].expand_as(ours)
    assert max_rel_err(ours[rows], theirs[rows]) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# 2. Sparse == dense when every visible key is selected


def test_sparse_equals_dense_fp32():
    config = tiny_config(index_topk=64)
    layer = make_layer(config)
    hidden = torch.randn(2, 40, config.hidden_size)
    pe = rope_for(config, hidden, positions(2, 0, 40))
    with torch.no_grad():
        ours, dense = layer(hidden, pe), dense_forward(layer, hidden, pe)
    # fp32 both sides, absorbed vs MHA association order only.
    assert max_rel_err(ours, dense) < 1e-5


def test_sparse_equals_dense_bf16():
    config = tiny_config(index_topk=64)
    layer32 = make_layer(config)
    layer16 = make_layer(config, dtype=torch.bfloat16)
    hidden = torch.randn(2, 40, config.hidden_size)
    pe = rope_for(config, hidden, positions(2, 0, 40))
    with torch.no_grad():
        ours = layer16(hidden.bfloat16(), tuple(t.bfloat16() for t in pe))
        dense = dense_forward(layer32, hidden, pe)
    # bf16 weights/activations (8-bit mantissa, ~4e-3 per rounding) through ~6 chained projections: ~6e-3 measured.
    assert max_rel_err(ours, dense) < 2e-2


# ---------------------------------------------------------------------------------------------------------------
# 3. Cache: decode and chunked prefill equal one full forward


def test_decode_and_chunked_prefill_match_full():
    config = tiny_config(index_topk=8)  # context 40 > topk: the selection really is sparse
    layer = make_layer(config)
    batch, prompt, seq_len = 2, 24, 40
    hidden = torch.randn(batch, seq_len, config.hidden_size)
    pe = rope_for(config, hidden, positions(batch, 0, seq_len))
    with torch.no_grad():
        full = layer(hidden, pe)

        cache = KDSACache(config)
        steps = [layer(hidden[:, :prompt], (pe[0][:, :prompt], pe[1][:, :prompt]), cache=cache)]
        for t in range(prompt, seq_len):
            steps.append(layer(hidden[:, t : t + 1], (pe[0][:, t : t + 1], pe[1][:, t : t + 1]), cache=cache))
        decoded = torch.cat(steps, dim=1)
        assert cache.layers[0].num_tokens == seq_len

        cache = KDSACache(config)
        split = 17
        first = layer(hidden[:, :split], (pe[0][:, :split], pe[1][:, :split]), cache=cache)
        second = layer(hidden[:, split:], (pe[0][:, split:], pe[1][:, split:]), cache=cache)
        chunked = torch.cat((first, second), dim=1)
    # Same fp32 math; only matmul shapes differ (blocking order): ~1e-7 relative.
    assert max_rel_err(decoded, full) < 1e-5
    assert max_rel_err(chunked, full) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# 4. Left padding


def test_left_padding_matches_unpadded_prompt():
    config = tiny_config(index_topk=8)
    layer = make_layer(config)
    pad, length, decode_steps = 5, 20, 4
    total = pad + length + decode_steps
    hidden = torch.randn(2, total, config.hidden_size)
    mask = torch.ones(2, total, dtype=torch.long)
    mask[0, :pad] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    pe = rope_for(config, hidden, position_ids)

    with torch.no_grad():
        cache = KDSACache(config)
        prefill_end = pad + length
        padded = [
            layer(
                hidden[:, :prefill_end], (pe[0][:, :prefill_end], pe[1][:, :prefill_end]), mask[:, :prefill_end], cache
            )
        ]
        for t in range(prefill_end, total):
            step_pe = (pe[0][:, t : t + 1], pe[1][:, t : t + 1])
            padded.append(layer(hidden[:, t : t + 1], step_pe, mask[:, : t + 1], cache))
        padded = torch.cat(padded, dim=1)

        alone_hidden = hidden[:1, pad:]
        alone = layer(alone_hidden, rope_for(config, alone_hidden, positions(1, 0, length + decode_steps)))
    # fp32; padding keys are excluded exactly, so only matmul-shape rounding differs.
    assert max_rel_err(padded[0, pad:], alone[0]) < 1e-5
    # Query rows at padding positions see no key at all: output is o_proj(0) = 0 (no bias), never NaN.
    assert torch.equal(padded[0, :pad], torch.zeros_like(padded[0, :pad]))


# ---------------------------------------------------------------------------------------------------------------
# 5. Query blocks: results and memory


def test_query_block_size_does_not_change_results():
    config = tiny_config(index_topk=8)
    layer = make_layer(config)
    hidden = torch.randn(2, 50, config.hidden_size)
    pe = rope_for(config, hidden, positions(2, 0, 50))
    results = []
    with torch.no_grad():
        for block in (1, 7, 1000):
            layer.query_block_size = block
            results.append(layer(hidden, pe))
    # Each query row's math is the same in every block; only matmul batching differs.
    for other in results[1:]:
        assert max_rel_err(other, results[0]) < 1e-5


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) produced by any op while active."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.max_numel = max(self.max_numel, tensor.numel())
        return out


def test_prefill_never_allocates_quadratic_tensors():
    config = tiny_config(index_topk=16, index_n_heads=4)
    layer = make_layer(config)
    seq_len, block = 512, 32
    hidden = torch.randn(1, seq_len, config.hidden_size)
    pe = rope_for(config, hidden, positions(1, 0, seq_len))
    heads = config.num_attention_heads
    # Largest legitimate tensors: per-token projections [T, H, C] and a block's indexer logits [block, S].
    widest_row = heads * max(config.kv_lora_rank, config.qk_head_dim, config.v_head_dim)
    allowed = max(seq_len * widest_row, block * seq_len)
    assert allowed * 4 <= heads * seq_len * seq_len  # the bound is far below one [H, T, T] tensor

    def largest(block_size: int) -> int:
        layer.query_block_size = block_size
        with torch.no_grad(), LargestTensor() as probe:
            layer(hidden, pe)
        return probe.max_numel

    assert largest(block) <= allowed
    # The probe can fail: one block of all T queries materialises [T, S] logits, above the bound.
    assert largest(seq_len) > allowed


# ---------------------------------------------------------------------------------------------------------------
# 6. NoPE and direct query projection


@pytest.mark.parametrize(
    "overrides",
    [dict(qk_rope_head_dim=0), dict(q_lora_rank=None), dict(qk_rope_head_dim=0, q_lora_rank=None)],
    ids=["nope", "no-q-lora", "nope-no-q-lora"],
)
def test_variants_match_dense(overrides):
    config = tiny_config(index_topk=64, **overrides)
    layer = make_layer(config)
    if config.q_lora_rank is None:
        assert layer.indexer.wq_b.in_features == config.hidden_size and not hasattr(layer, "q_a_proj")
    hidden = torch.randn(2, 30, config.hidden_size)
    pe = rope_for(config, hidden, positions(2, 0, 30))
    with torch.no_grad():
        ours, dense = layer(hidden, pe), dense_forward(layer, hidden, pe)
        # Sparsity also runs: with topk 8 < 30 the output differs from dense but stays finite.
        layer.index_topk = 8
        sparse = layer(hidden, pe)
    # fp32, association order only.
    assert max_rel_err(ours, dense) < 1e-5
    assert torch.isfinite(sparse).all() and not torch.allclose(sparse, dense, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# Kernels on their own


def test_sparse_attention_handles_invalid_slots():
    torch.manual_seed(0)
    q_latent, q_pe = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 4)
    latent, k_pe = torch.randn(1, 6, 8), torch.randn(1, 6, 4)
    indices = torch.tensor([[[2, 0, -1], [-1, -1, -1], [5, -1, 1]]])
    out = dsa_ops.sparse_mla_attention(q_latent, q_pe, latent, k_pe, indices, 0.5)
    assert torch.equal(out[0, 1], torch.zeros(2, 8))  # lonely row -> 0
    # Row 0 by hand over keys {2, 0}: exact same fp32 ops up to summation order.
    keys = torch.tensor([2, 0])
    logits = (q_latent[0, 0] @ latent[0, keys].T + q_pe[0, 0] @ k_pe[0, keys].T) * 0.5
    expected = torch.softmax(logits, -1) @ latent[0, keys]
    torch.testing.assert_close(out[0, 0], expected, rtol=1e-6, atol=1e-6)


def test_indexer_scores_formula():
    torch.manual_seed(0)
    q, w, k = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3), torch.randn(2, 7, 4)
    visible = torch.rand(2, 5, 7) > 0.3
    scores = dsa_ops.indexer_scores(q, w, k, visible)
    # docs/dsa.md §1: I[t,s] = HI^-0.5 · DI^-0.5 · Σ_h w[t,h] · ReLU(q[t,h]·k[s]), written independently.
    expected = torch.einsum("bth,bths->bts", w, torch.einsum("bthd,bsd->bths", q, k).relu()) * (3 * 4) ** -0.5
    expected = expected.masked_fill(~visible, float("-inf"))
    # fp32, summation order only.
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-6)


def test_indexer_topk_is_causal_and_pads_with_minus_one():
    torch.manual_seed(0)
    q, w, k = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2), torch.randn(1, 6, 4)
    key_mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    indices = dsa_ops.indexer_topk(q, w, k, index_topk=3, query_start=0, key_padding_mask=key_mask)
    for t in range(6):
        valid = [i for i in indices[0, t].tolist() if i >= 0]
        assert all(1 <= i <= t for i in valid) and len(valid) == min(t, 3)
        # -1 only at the tail
        assert indices[0, t, len(valid) :].eq(-1).all()


# ---------------------------------------------------------------------------------------------------------------
# 7. Bad input


def test_bad_inputs_raise_clear_errors():
    config = tiny_config()
    layer = make_layer(config)
    hidden = torch.randn(1, 5, config.hidden_size)
    pe = rope_for(config, hidden, positions(1, 0, 5))
    with pytest.raises(ValueError, match="hidden_size=64"):
        layer(torch.randn(1, 5, 32), pe)
    with pytest.raises(ValueError, match="position_embeddings"):
        layer(hidden, None)
    with pytest.raises(ValueError, match="cos must have shape"):
        layer(hidden, (pe[0][:, :3], pe[1][:, :3]))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(hidden, pe, attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="needs a KDSACache"):
        layer(hidden, pe, cache=DynamicCache(config=config))
    nope_layer = make_layer(tiny_config(qk_rope_head_dim=0))
    with pytest.raises(ValueError, match="NoPE"):
        nope_layer(hidden, pe)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        KDSARotaryEmbedding(tiny_config(qk_rope_head_dim=0))

    # A rejected call leaves the cache untouched.
    cache = KDSACache(config)
    with torch.no_grad():
        layer(hidden, pe, cache=cache)
        with pytest.raises(ValueError, match="attention_mask"):
            layer(hidden[:, :1], (pe[0][:, :1], pe[1][:, :1]), torch.ones(1, 1), cache)
    assert cache.layers[0].num_tokens == 5
