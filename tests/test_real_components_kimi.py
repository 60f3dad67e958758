"""Components the Kimi-Linear and DeepSeek-V3.2 checkpoints need, each against the transformers module that defines it.

- Dense MLA (`"full_attention"`, `KDSAMultiLatentAttention`, docs/dsa.md §8) vs transformers' `KimiLinearAttention`:
  prefill and token-by-token decode through `KDSACache` on every kernel backend, left padding; its paged store
  (`KDSAPagedMLALayer`: no indexer keys) under crop, reorder/batch select, quantized latent pages, memory_bytes;
  the fused dense kernel vs the reference with many key blocks, and its memory bound.
- `mla_use_nope` (rope slice kept, never rotated) and `mla_layernorm_eps` (Kimi: 1e-6 latent norms, 1e-5 elsewhere).
- Group-limited routing (`n_group`, `topk_group`) vs transformers' `KimiLinearTopkRouter` / `DeepseekV32TopkRouter`
  and `DeepseekV32MoE`.
- A whole tiny model with KDA, DSA and dense MLA layers, NoPE-with-slice and grouped routing: prefill == decode,
  generate, save/load; context-parallel prefill (cp = tp = 1) == the model.

Every oracle weight is redrawn at random (norm weights included), so a wrong mapping cannot hide behind ones/zeros.
"""

import pytest
import torch
from conftest import tiny_model
from test_dsa import LargestTensor
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32MoE, DeepseekV32TopkRouter
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention, KimiLinearTopkRouter

from modeling_kdsa import KDSAConfig, KDSAForCausalLM, KDSAQuantizationConfig, dsa_paged_fused
from modeling_kdsa.cache import ROLLBACK_TOKENS, KDSACache, KDSAPagedMLALayer
from modeling_kdsa.dsa import KDSAMultiLatentAttention
from modeling_kdsa.dsa_paged_common import PagedKeys
from modeling_kdsa.dsa_paged_fused import paged_dense_mla_fused
from modeling_kdsa.kernels import kernel_set
from modeling_kdsa.moe import KDSAMoE, KDSATopkRouter
from modeling_kdsa.rotary import KDSARotaryEmbedding

BACKENDS = ["compiled", "cpu", "torch"]
# fp32 throughout: transformers' eager MHA-form attention vs our absorbed form differ by summation order only.
REL_TOL = 1e-5


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def mla_config(**overrides) -> KDSAConfig:
    """A one-layer dense-MLA config with Kimi-Linear's choices: NoPE-with-slice, latent-norm eps 1e-6 vs 1e-5."""
    fields = dict(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        layer_types=["full_attention"],
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rms_norm_eps=1e-5,
        mla_layernorm_eps=1e-6,
        mla_use_nope=True,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        attn_res_block_size=0,
        max_position_embeddings=4096,
    )
    fields.update(overrides)
    return KDSAConfig(**fields)


def kimi_attention_for(config: KDSAConfig, seed: int = 0) -> KimiLinearAttention:
    """transformers' Kimi-Linear MLA for `config`, every parameter redrawn (norm weights around 1, not 1)."""
    hf_config = KimiLinearConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rms_norm_eps=config.rms_norm_eps,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf_config._attn_implementation = "eager"
    oracle = KimiLinearAttention(hf_config, layer_idx=0).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in oracle.named_parameters():
            if "layernorm" in name:
                param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return oracle


def our_attention_from(oracle: KimiLinearAttention, config: KDSAConfig) -> KDSAMultiLatentAttention:
    ours = KDSAMultiLatentAttention(config, layer_idx=0).eval()
    ours.load_state_dict(oracle.state_dict(), strict=True)  # same weight names
    return ours


def hf_mask(attention_mask: torch.Tensor | None, batch: int, seq_len: int) -> torch.Tensor:
    """Additive causal (+ padding) mask `[B, 1, T, T]` for the eager oracle."""
    visible = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[None].expand(batch, -1, -1)
    if attention_mask is not None:
        visible = visible & attention_mask.bool()[:, None, :]
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[:, None]


def oracle_output(oracle, hidden, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        return oracle(hidden, attention_mask=hf_mask(attention_mask, *hidden.shape[:2]))[0]


# ------------------------------------------------------------------------------------------------- dense MLA


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_dense_mla_matches_kimi_prefill_and_decode(backend, q_lora_rank):
    """Prefill of 150 tokens (two query blocks of 128, three pages) and a decode step by step through KDSACache
    equal KimiLinearAttention's causal output at every position."""
    config = mla_config(kernel_backend=backend, q_lora_rank=q_lora_rank)
    oracle = kimi_attention_for(config)
    ours = our_attention_from(oracle, config)
    hidden = torch.randn(2, 150, config.hidden_size, generator=torch.Generator().manual_seed(1))
    expected = oracle_output(oracle, hidden)
    with torch.no_grad():
        assert max_rel_err(ours(hidden, cache=KDSACache(config)), expected) < REL_TOL
        cache = KDSACache(config)
        ours(hidden[:, :100], cache=cache)  # chunked prefill, then one token at a time
        steps = [ours(hidden[:, t : t + 1], cache=cache) for t in range(100, 150)]
    assert max_rel_err(torch.cat(steps, dim=1), expected[:, 100:]) < REL_TOL
    assert isinstance(cache.layers[0], KDSAPagedMLALayer) and not hasattr(cache.layers[0], "index_pages")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_dense_mla_left_padding_matches_kimi(backend):
    config = mla_config(kernel_backend=backend)
    oracle = kimi_attention_for(config, seed=2)
    ours = our_attention_from(oracle, config)
    hidden = torch.randn(2, 40, config.hidden_size, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :13] = 0  # sequence 1 is left-padded by 13 tokens
    expected = oracle_output(oracle, hidden, mask)
    with torch.no_grad():
        cache = KDSACache(config)
        prefill = ours(hidden[:, :30], attention_mask=mask[:, :30], cache=cache)
        steps = [ours(hidden[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache) for t in range(30, 40)]
    got = torch.cat([prefill, *steps], dim=1)
    real = mask.bool()
    assert max_rel_err(got[real], expected[real]) < REL_TOL


def test_nope_slice_and_latent_norm_eps_matter():
    """The oracle check is sharp enough to see both Kimi details: rotating the rope slice, or building the latent
    norms with rms_norm_eps, moves the output well beyond the tolerance (inputs small enough for eps to count)."""
    config = mla_config()
    oracle = kimi_attention_for(config, seed=4)
    hidden = 0.05 * torch.randn(1, 24, config.hidden_size, generator=torch.Generator().manual_seed(5))
    expected = oracle_output(oracle, hidden)
    with torch.no_grad():
        assert max_rel_err(our_attention_from(oracle, config)(hidden), expected) < REL_TOL
        rotated = mla_config(mla_use_nope=False)
        cos_sin = KDSARotaryEmbedding(rotated)(hidden, torch.arange(24)[None])
        assert max_rel_err(our_attention_from(oracle, rotated)(hidden, cos_sin), expected) > 1e-3
        assert max_rel_err(our_attention_from(oracle, mla_config(mla_layernorm_eps=None))(hidden), expected) > 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_dense_kernel_equals_reference_over_many_blocks(backend, monkeypatch):
    """Tiny blocks force many query chunks and key blocks (online softmax across pages), scattered pages, padding,
    a query_start inside the context and a fully padded query row (gives 0)."""
    monkeypatch.setattr(dsa_paged_fused, "DENSE_BLOCK_ELEMENTS", 256)
    generator = torch.Generator().manual_seed(6)
    page_size, num_pages = 4, 12
    kv_pages = torch.randn(num_pages, page_size, 20, generator=generator)
    block_table = torch.tensor([[7, 2, 9, 0, 11, -1], [1, 3, 4, 5, 6, 8]])
    num_keys, queries = 19, 6
    q_latent = torch.randn(2, queries, 3, 16, generator=generator)
    q_pe = torch.randn(2, queries, 3, 4, generator=generator)
    padding = torch.ones(2, num_keys, dtype=torch.bool)
    padding[1, :15] = False  # sequence 1: its first query (position 13) sees no key at all
    args = (PagedKeys(kv_pages, block_table, num_keys, num_keys - queries, padding), 0.3)
    expected = kernel_set("torch").dense_mla(q_latent, q_pe, *args)
    got = kernel_set(backend).dense_mla(q_latent, q_pe, *args)
    assert max_rel_err(got, expected) < REL_TOL
    assert torch.equal(got[1, :2], torch.zeros_like(got[1, :2]))
    assert expected[1, 2:].abs().amax() > 0


def test_fused_dense_kernel_never_builds_the_score_matrix(monkeypatch):
    """A 512-query prefill over 2048 keys with the block bound at 64K elements: no tensor exceeds it, so none is as
    large as one head's `[T, S]` scores (1M), let alone all heads' (4M). The output `[T, H, C]` is the bound here."""
    monkeypatch.setattr(dsa_paged_fused, "DENSE_BLOCK_ELEMENTS", 1 << 16)
    generator = torch.Generator().manual_seed(7)
    heads, num_keys, queries, page_size = 4, 2048, 512, 64
    kv_pages = torch.randn(num_keys // page_size, page_size, 40, generator=generator)
    block_table = torch.arange(num_keys // page_size)[None]
    q_latent = torch.randn(1, queries, heads, 32, generator=generator)
    q_pe = torch.randn(1, queries, heads, 8, generator=generator)
    with LargestTensor() as probe:
        paged_dense_mla_fused(q_latent, q_pe, PagedKeys(kv_pages, block_table, num_keys, num_keys - queries), 0.2)
    assert probe.max_numel <= 1 << 16 < queries * num_keys


def test_fused_dense_decode_reads_bounded_row_blocks(monkeypatch):
    """A decode step's key blocks hold at most DENSE_BLOCK_ELEMENTS row elements (the rows are read twice, scores then
    values, so the bound keeps them in cache), and the output is the same as with one block."""
    generator = torch.Generator().manual_seed(8)
    heads, num_keys, width, page_size = 4, 2048, 40, 64
    kv_pages = torch.randn(num_keys // page_size, page_size, width, generator=generator)
    block_table = torch.arange(num_keys // page_size)[None]
    q_latent = torch.randn(1, 1, heads, 32, generator=generator)
    q_pe = torch.randn(1, 1, heads, 8, generator=generator)
    args = (q_latent, q_pe, PagedKeys(kv_pages, block_table, num_keys, num_keys - 1), 0.2)
    whole = paged_dense_mla_fused(*args)  # one block: 2048 rows are within the default bound
    monkeypatch.setattr(dsa_paged_fused, "DENSE_BLOCK_ELEMENTS", 4 * page_size * width)
    with LargestTensor() as probe:
        blocked = paged_dense_mla_fused(*args)
    assert probe.max_numel == 4 * page_size * width  # a block of 4 pages' rows is the largest tensor
    torch.testing.assert_close(blocked, whole, atol=1e-5, rtol=1e-5)


def test_dense_store_bytes_and_quantized_latent():
    """No indexer plane: a token costs `(C + R) · itemsize`; with the FP8 latent the kernels read the dequantized
    rows (torch and cpu agree exactly on the same quantized store) and stay within FP8 error of the plain cache."""
    quantization = KDSAQuantizationConfig(kv_cache="fp8", kv_cache_tile_size=16)
    config = mla_config(kernel_backend="torch")
    oracle = kimi_attention_for(config, seed=8)
    ours = our_attention_from(oracle, config)
    hidden = torch.randn(1, 70, config.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        plain_cache = KDSACache(config)
        plain = ours(hidden, cache=plain_cache)
        config.quantization_config = quantization
        quantized_cache = KDSACache(config)
        quantized = ours(hidden, cache=quantized_cache)
        store = quantized_cache.layers[0]
        q_latent = torch.randn(1, 70, 4, 32, generator=torch.Generator().manual_seed(10))
        q_pe = torch.randn(1, 70, 4, 8, generator=torch.Generator().manual_seed(11))
        args = (PagedKeys(store.kv_pages, store.block_table, 70, 0), 0.2)
        fused = kernel_set("cpu").dense_mla(q_latent, q_pe, *args)
        assert max_rel_err(fused, kernel_set("torch").dense_mla(q_latent, q_pe, *args)) < REL_TOL
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert plain_cache.memory_bytes()["per_token"] == width * 4
    # FP8 latent: 1 byte per element + one fp32 scale per tile of 16; the RoPE slice stays fp32.
    assert quantized_cache.memory_bytes()["per_token"] == 32 + (32 // 16) * 4 + 8 * 4
    usage = plain_cache.memory_bytes()
    assert usage["dsa_in_use"] == 2 * 64 * width * 4 and usage["dsa_allocated"] >= usage["dsa_in_use"]
    assert 0 < max_rel_err(quantized, plain) < 0.1


def test_dense_store_crop_reorder_and_batch_select():
    config = mla_config(kernel_backend="cpu")
    ours = our_attention_from(kimi_attention_for(config, seed=12), config)
    hidden = torch.randn(2, 80, config.hidden_size, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        reference = ours(hidden, cache=KDSACache(config))
        # crop: a rejected draft of 5 tokens is cropped, then the true tokens go in.
        cache = KDSACache(config)
        ours(hidden[:, :66], cache=cache)
        ours(torch.randn(2, 5, config.hidden_size), cache=cache)
        cache.layers[0].crop(-5)  # the model crops every layer through KDSACache.crop (test_mixed_model_...)
        assert cache.layers[0].num_tokens == 66
        assert max_rel_err(ours(hidden[:, 66:], cache=cache), reference[:, 66:]) < REL_TOL
        # reorder (beams): both rows take sequence 1's pages; batch_select keeps sequence 1 only.
        cache = KDSACache(config)
        ours(hidden[:, :70], cache=cache)
        cache.reorder_cache(torch.tensor([1, 1]))
        step = ours(hidden[1:, 70:71].expand(2, -1, -1), cache=cache)
        assert max_rel_err(step, reference[1:, 70:71].expand(2, -1, -1)) < REL_TOL
        cache = KDSACache(config)
        ours(hidden[:, :70], cache=cache)
        cache.batch_select_indices(torch.tensor([1]))
        assert max_rel_err(ours(hidden[1:, 70:72], cache=cache), reference[1:, 70:72]) < REL_TOL


def test_dense_layer_refuses_a_dsa_cache_slot_and_bad_position_embeddings():
    config = mla_config()
    ours = our_attention_from(kimi_attention_for(config), config)
    hidden = torch.randn(1, 4, config.hidden_size)
    with pytest.raises(ValueError, match="position_embeddings must be None"):
        ours(hidden, (torch.ones(1, 4, 8), torch.zeros(1, 4, 8)))
    rotating = KDSAMultiLatentAttention(mla_config(mla_use_nope=False), 0)
    with pytest.raises(ValueError, match="position_embeddings"):
        rotating(hidden)
    dsa_cache = KDSACache(mla_config(layer_types=["indexed_attention"], index_head_dim=8))
    with pytest.raises(ValueError, match="KDSAPagedMLALayer"):
        ours(hidden, cache=dsa_cache)


# ------------------------------------------------------------------------------------------------ routing


def routing_configs(n_group: int, topk_group: int):
    fields = dict(hidden_size=32, num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True)
    ours = mla_config(n_routed_experts=16, n_group=n_group, topk_group=topk_group, **fields)
    kimi = KimiLinearConfig(num_experts=16, num_expert_group=n_group, topk_group=topk_group, **fields)
    deepseek = DeepseekV32Config(n_routed_experts=16, n_group=n_group, topk_group=topk_group, **fields)
    return ours, kimi, deepseek


def random_router(router_class, config, seed: int):
    router = router_class(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(
            0.3 * torch.randn(router.e_score_correction_bias.shape, generator=generator)
        )
    return router


def sorted_choice(indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = indices.argsort(dim=-1)
    return indices.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("oracle_class", [KimiLinearTopkRouter, DeepseekV32TopkRouter])
def test_grouped_router_matches_transformers(oracle_class):
    """16 experts in 4 groups, the best 2 groups kept, top-4: same experts, weights within 1e-6; and the grouping
    really changes the choice for many tokens (the ungrouped top-4 differs)."""
    ours_config, kimi_config, deepseek_config = routing_configs(n_group=4, topk_group=2)
    hf_config = kimi_config if oracle_class is KimiLinearTopkRouter else deepseek_config
    oracle = random_router(oracle_class, hf_config, seed=14)
    ours = KDSATopkRouter(ours_config)
    ours.load_state_dict(oracle.state_dict(), strict=True)
    tokens = torch.randn(64, 32, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        _, hf_weights, hf_indices = oracle(tokens)
        indices, weights = ours(tokens)
    hf_indices, hf_weights = sorted_choice(hf_indices, hf_weights)
    indices, weights = sorted_choice(indices, weights)
    assert torch.equal(indices, hf_indices)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
    ungrouped = KDSATopkRouter(routing_configs(n_group=1, topk_group=1)[0])
    ungrouped.load_state_dict(oracle.state_dict())
    with torch.no_grad():
        plain_indices = ungrouped(tokens)[0].sort(dim=-1).values
    assert (plain_indices != indices).any(dim=-1).sum() >= 8


def test_default_routing_is_bit_identical_to_plain_topk():
    config = mla_config(n_routed_experts=16, num_experts_per_tok=4, hidden_size=32)
    router = random_router(KDSATopkRouter, config, seed=16)
    tokens = torch.randn(64, 32, generator=torch.Generator().manual_seed(17))
    with torch.no_grad():
        indices, weights = router(tokens)
        scores = torch.nn.functional.linear(tokens, router.weight).sigmoid()
        expected = torch.topk(scores + router.e_score_correction_bias, k=4, dim=-1).indices
        chosen = scores.gather(-1, expected)
    assert torch.equal(indices, expected)
    assert torch.equal(weights, chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * config.routed_scaling_factor)


def test_grouped_moe_matches_deepseek_v32():
    ours_config, _, hf_config = routing_configs(n_group=4, topk_group=2)
    hf_config.moe_intermediate_size = ours_config.moe_intermediate_size
    hf_config.n_shared_experts = 1
    hf_config._experts_implementation = "eager"
    oracle = DeepseekV32MoE(hf_config)
    generator = torch.Generator().manual_seed(18)
    with torch.no_grad():
        for param in oracle.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        oracle.gate.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=generator))
    ours = KDSAMoE(ours_config)
    ours.load_state_dict(oracle.state_dict(), strict=True)
    hidden = torch.randn(3, 11, 32, generator=torch.Generator().manual_seed(19))
    with torch.no_grad():
        assert max_rel_err(ours(hidden), oracle(hidden)) < 2e-6


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(n_group=3), "n_group"),
        (dict(n_group=4, topk_group=5), "topk_group"),
        (dict(n_group=4, topk_group=0), "topk_group"),
        (dict(n_group=16, topk_group=2, num_experts_per_tok=1), "two"),
        (dict(n_group=4, topk_group=1, num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(mla_layernorm_eps=0.0), "mla_layernorm_eps"),
    ],
)
def test_bad_routing_and_mla_fields_raise(overrides, words):
    with pytest.raises(ValueError, match=words):
        mla_config(n_routed_experts=16, **overrides)


# ------------------------------------------------------------------------------------------------- model


def mixed_model(seed: int = 0, **overrides) -> KDSAForCausalLM:
    fields = dict(
        num_hidden_layers=3,
        layer_types=["linear_attention", "indexed_attention", "full_attention"],
        mla_use_nope=True,
        mla_layernorm_eps=1e-6,
        rms_norm_eps=1e-5,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        attn_res_block_size=0,
    )
    fields.update(overrides)
    return tiny_model(seed, **fields)


def test_mixed_model_prefill_equals_decode_generates_and_round_trips(tmp_path):
    model = mixed_model()
    assert model.model.rotary_emb is not None  # the DSA indexer still rotates
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(20))
    with torch.no_grad():
        full = model(ids).logits
        cache = KDSACache(model.config)
        steps = torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(20)], dim=1)
    assert max_rel_err(steps, full) < REL_TOL
    generated = model.generate(ids[:, :6], max_new_tokens=8, do_sample=False)
    assert generated.shape == (2, 14)
    model.save_pretrained(tmp_path)
    reloaded = KDSAForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.layer_types[2] == "full_attention" and reloaded.config.n_group == 4
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, full)


def test_mixed_model_speculative_crop_and_beams():
    model = mixed_model(seed=1)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        reference = model(ids).logits
        cache = KDSACache(model.config, rollback_tokens=ROLLBACK_TOKENS)
        model(ids[:, :24], cache=cache)
        model(torch.randint(3, 128, (2, 4)), cache=cache)  # a rejected draft
        cache.crop(-4)
        assert max_rel_err(model(ids[:, 24:], cache=cache).logits, reference[:, 24:]) < REL_TOL
    beams = model.generate(ids[:, :8], max_new_tokens=4, num_beams=2, do_sample=False)
    assert beams.shape == (2, 12)


def test_no_rotary_table_when_nothing_rotates():
    model = mixed_model(layer_types=["linear_attention", "full_attention", "full_attention"])
    assert model.model.rotary_emb is None
    rotating = mixed_model(layer_types=["linear_attention", "full_attention", "full_attention"], mla_use_nope=False)
    assert rotating.model.rotary_emb is not None


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_context_parallel_prefill_with_dense_mla_matches_model(layout):
    from modeling_kdsa.parallel import context_parallel_prefill, single_process_mesh

    for model in (mixed_model(seed=2), mixed_model(seed=3, mla_use_nope=False)):
        ids = torch.randint(3, 128, (2, 29), generator=torch.Generator().manual_seed(22))
        with torch.no_grad():
            reference_cache = KDSACache(model.config)
            reference = model(ids, cache=reference_cache).logits
        cache = KDSACache(model.config)
        out = context_parallel_prefill(model, ids, single_process_mesh(), layout=layout, cache=cache)
        assert max_rel_err(out.logits, reference) < 1e-5
        ours, theirs = cache.layers[2], reference_cache.layers[2]
        rows = torch.arange(29).expand(2, -1)
        stored = ours.kv_pages.view(-1, ours.kv_width)[ours.physical_slots(rows)]
        assert torch.allclose(stored, theirs.kv_pages.view(-1, theirs.kv_width)[theirs.physical_slots(rows)], atol=1e-5)


def test_tensor_parallel_head_sharding_of_a_dense_layer_sums_to_the_whole():
    """`apply_tensor_parallel` shards a dense MLA layer like a DSA layer's MLA (heads of q_b / kv_b / o_proj; the
    latent projections are replicated): emulated in one process, the two tp shards' o_proj outputs (what the
    all-reduce hook adds) sum to the unsharded layer's output, prefill and decode."""
    import copy

    from modeling_kdsa.parallel.tensor_parallel import mla_shard_plan, shard_in_place

    config = mla_config(kernel_backend="cpu")
    whole = our_attention_from(kimi_attention_for(config, seed=23), config)
    shards = [copy.deepcopy(whole) for _ in range(2)]
    for rank, shard in enumerate(shards):
        shard_in_place(mla_shard_plan(shard), rank, 2)
    hidden = torch.randn(2, 30, config.hidden_size, generator=torch.Generator().manual_seed(24))
    with torch.no_grad():
        caches = [KDSACache(config) for _ in range(3)]
        expected = torch.cat([whole(hidden[:, :25], cache=caches[0]), whole(hidden[:, 25:], cache=caches[0])], 1)
        parts = [
            torch.cat([shard(hidden[:, :25], cache=cache), shard(hidden[:, 25:], cache=cache)], 1)
            for shard, cache in zip(shards, caches[1:], strict=True)
        ]
    assert shards[0].num_heads == 2
    assert max_rel_err(parts[0] + parts[1], expected) < REL_TOL
