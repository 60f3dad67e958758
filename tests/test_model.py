"""Whole-model behaviour: config validation, generate with/without cache, padding, save/load, remote code."""

import json
import textwrap

import pytest
import torch
from conftest import run_without_the_package, tiny_config, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from modeling_kdsa import KDSAConfig, KDSAForCausalLM

PROMPT_LEN = 21  # > index_topk (8): the DSA layers really select a subset of the context


def prompt(batch=1, length=PROMPT_LEN, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=generator)


# ----------------------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "overrides, field",
    [
        (
            dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "indexed_attention"]),
            "layer_types",
        ),
        (dict(layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(index_topk=0), "index_topk"),
        (dict(index_topk=-4), "index_topk"),
        (dict(index_head_dim=4), "index_head_dim"),  # smaller than the rope slice it must rotate
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(linear_head_dim=0), "linear_head_dim"),
        (dict(kernel_backend="cuda-magic"), "kernel_backend"),
        (dict(attn_res_block_size=-1), "attn_res_block_size"),
    ],
)
def test_inconsistent_config_raises_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_config_round_trip(tmp_path):
    config = tiny_config()
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, KDSAConfig)
    # `_name_or_path` records where the config was loaded from; everything else must survive unchanged.
    assert {**loaded.to_dict(), "_name_or_path": ""} == {**config.to_dict(), "_name_or_path": ""}


def test_bad_attention_mask_raises(model):
    ids = prompt()
    with pytest.raises(ValueError, match="2-D padding mask"):
        model(ids, attention_mask=torch.ones(1, 1, PROMPT_LEN, PROMPT_LEN))
    with pytest.raises(ValueError, match="does not match"):
        model(ids, attention_mask=torch.ones(1, PROMPT_LEN + 3, dtype=torch.long))


# ------------------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("attn_res_block_size", [0, 2, 3])
def test_greedy_generate_with_cache_equals_recompute(attn_res_block_size):
    model = tiny_model(attn_res_block_size=attn_res_block_size)
    ids = prompt(batch=2)
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    without_cache = model.generate(ids, use_cache=False, **kwargs)
    assert with_cache.shape == (2, PROMPT_LEN + 32)
    assert torch.equal(with_cache, without_cache)


def test_incremental_logits_match_full_forward(model):
    """Prefill 13 tokens, then 5 one at a time and a 3-token chunk: logits equal the single full forward.
    fp32; 2e-5 absolute allows for the chunked vs recurrent KDA kernels' different summation order."""
    ids = prompt(length=21)
    full = model(ids, use_cache=False).logits
    out = model(ids[:, :13], use_cache=True)
    pieces, cache = [out.logits], out.cache
    for t in range(13, 18):
        out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
        pieces.append(out.logits)
    out = model(ids[:, 18:], cache=cache, use_cache=True)
    pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-5, rtol=0)


def test_left_padded_batch_rows_equal_each_prompt_alone(model):
    short, long = prompt(length=12, seed=3), prompt(length=PROMPT_LEN, seed=4)
    pad = PROMPT_LEN - 12
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], dim=1), long])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    batched = model.generate(batch, attention_mask=mask, **kwargs)
    alone_short = model.generate(short, **kwargs)
    alone_long = model.generate(long, **kwargs)
    assert torch.equal(batched[0, pad:], alone_short[0])
    assert torch.equal(batched[1], alone_long[0])


def test_beam_search_with_cache_equals_without(model):
    ids = prompt(batch=2)
    kwargs = dict(max_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0, early_stopping=True)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_sampling_is_seeded_and_uses_the_cache(model):
    ids = prompt()
    kwargs = dict(max_new_tokens=16, do_sample=True, top_k=20, temperature=0.8, pad_token_id=0)
    torch.manual_seed(7)
    first = model.generate(ids, **kwargs)
    torch.manual_seed(7)
    second = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(first, second)


# ------------------------------------------------------------------------------------------------ persistence


def test_save_load_gives_bit_identical_logits(model, tmp_path):
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is KDSAForCausalLM
    ids = prompt()
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_bf16_load_keeps_gates_and_router_in_fp32(model, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    params = dict(loaded.named_parameters())
    assert params["model.layers.0.linear_attn.A_log"].dtype == torch.float32
    assert params["model.layers.0.linear_attn.dt_bias"].dtype == torch.float32
    assert params["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert params["model.layers.0.linear_attn.q_proj.weight"].dtype == torch.bfloat16
    out = loaded.generate(prompt(), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, PROMPT_LEN + 8)


@pytest.mark.slow
def test_remote_code_load_without_the_package(model, tmp_path):
    """The saved folder must load with trust_remote_code=True in a Python where `modeling_kdsa` cannot be imported."""
    model.save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kdsa.KDSAForCausalLM"
    ids = prompt()
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        torch.save(model(ids).logits, {str(tmp_path / "logits.pt")!r})
        """
    )
    result = run_without_the_package(script, cwd=tmp_path, HF_MODULES_CACHE=tmp_path / "modules")
    assert result.returncode == 0, result.stderr[-3000:]
    remote_logits = torch.load(tmp_path / "logits.pt")
    assert torch.equal(remote_logits, model(ids).logits)
