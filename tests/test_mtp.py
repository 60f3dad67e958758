"""MTP layers (modeling_kdsa/mtp.py): the math against an independent transcription whose block is transformers' own
`DeepseekV32DecoderLayer`, cached == uncached, crop, left padding, native and remote-code save / reload, refusals.

The fixture is a tiny DeepSeek-V3.2 hub folder whose MTP layer (`model.layers.3.*`) is layer 3 of a 4-layer
transformers model: its config declares 3 trunk layers and `num_nextn_predict_layers: 1`, and the folder adds
enorm, hnorm, eh_proj, shared_head.norm and the exact copies of the embedding and lm_head that DeepSeek ships.
"""

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_without_the_package
from safetensors.torch import load_file, save_file
from test_foreign_checkpoints import add_tensors, deepseek_v32_model, edit_config, perturb_constants
from transformers import DeepseekV32ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RMSNorm

from modeling_kdsa import KDSAConfig, KDSAForCausalLM
from modeling_kdsa.mtp import KDSAMTPCache, KDSAMultiTokenPredictor

SEQ = 32  # > 3 x index_topk (8): the MTP block's selection is really sparse


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


class DeepseekWithMTP:
    def __init__(self, folder):
        torch.manual_seed(0)
        config = deepseek_v32_model().config
        config.num_hidden_layers = 4
        config.layer_types = config.layer_types + config.layer_types[-1:]
        config.mlp_layer_types = config.mlp_layer_types + ["sparse"]
        self.reference = DeepseekV32ForCausalLM(config).eval()
        perturb_constants(self.reference)
        self.reference.save_pretrained(folder, max_shard_size="40KB")
        generator = torch.Generator().manual_seed(3)
        hidden = config.hidden_size
        self.extra = {
            "model.layers.3.enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
            "model.layers.3.hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
            "model.layers.3.eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=generator),
            "model.layers.3.shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
            "model.layers.3.shared_head.head.weight": self.reference.lm_head.weight.detach().clone(),
            "model.layers.3.embed_tokens.weight": self.reference.model.embed_tokens.weight.detach().clone(),
        }
        add_tensors(folder, self.extra)
        trunk = config.to_dict()
        edit_config(
            folder,
            num_hidden_layers=3,
            num_nextn_predict_layers=1,
            layer_types=trunk["layer_types"][:3],
            mlp_layer_types=trunk["mlp_layer_types"][:3],
        )
        # transformers' trunk: its model runs `layers[:num_hidden_layers]`.
        self.reference.config.num_hidden_layers = 3
        self.folder = folder
        self.model = KDSAForCausalLM.from_pretrained(folder).eval()
        self.ids = torch.randint(3, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))

    def transcription(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3 §2.2 written out with transformers' modules: RMSNorms, eh_proj over [enorm(emb) ; hnorm(h)],
        `DeepseekV32DecoderLayer` (the 4-layer model's layer 3) over the whole sequence with no cache and its causal
        mask, then shared_head.norm and the lm_head. Positions 0 .. T-1."""
        reference, config = self.reference, self.reference.config

        def norm(weight):
            module = DeepseekV32RMSNorm(config.hidden_size, config.rms_norm_eps)
            module.weight.data.copy_(weight)
            return module

        embeddings = reference.model.embed_tokens(next_ids)
        joined = torch.cat(
            [
                norm(self.extra["model.layers.3.enorm.weight"])(embeddings),
                norm(self.extra["model.layers.3.hnorm.weight"])(hidden),
            ],
            dim=-1,
        )
        x = joined @ self.extra["model.layers.3.eh_proj.weight"].T
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        mask = create_causal_mask(
            config=config,
            inputs_embeds=x,
            attention_mask=None,
            cache=None,
            position_ids=positions,
            allow_is_causal_skip=False,
        )
        block = reference.model.layers[3]
        x = block(
            x,
            attention_mask=mask,
            position_embeddings=reference.model.rotary_emb(x, positions),
            position_ids=positions,
        )
        return reference.lm_head(norm(self.extra["model.layers.3.shared_head.norm.weight"])(x))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return DeepseekWithMTP(tmp_path_factory.mktemp("deepseek_mtp") / "hub")


def trunk_hidden(model, ids, attention_mask=None):
    with torch.no_grad():
        return model.model(ids, attention_mask=attention_mask).last_hidden_state


def test_mtp_matches_a_transcription_with_transformers_decoder_layer(deepseek):
    model, ids = deepseek.model, deepseek.ids
    hidden = trunk_hidden(model, ids)
    with torch.no_grad():
        ours = model.mtp.logits(0, model.mtp(0, hidden[:, :-1], ids[:, 1:]))
        reference = deepseek.transcription(hidden[:, :-1], ids[:, 1:])
        # transformers' own trunk gives the same hidden states the MTP layer reads
        assert relative_error(hidden, deepseek.reference.model(ids).last_hidden_state) < 1e-5
    assert ours.shape == (2, SEQ - 1, model.config.vocab_size)
    assert relative_error(ours, reference) < 1e-5


def test_cached_chunk_then_steps_equal_the_uncached_forward(deepseek):
    model, ids = deepseek.model, deepseek.ids
    hidden, next_ids = trunk_hidden(model, ids)[:, :-1], ids[:, 1:]
    with torch.no_grad():
        whole = model.mtp(0, hidden, next_ids)
        cache = model.mtp.new_cache(rollback_tokens=16)
        assert isinstance(cache, KDSAMTPCache) and cache.get_seq_length(0) == 0
        parts = [model.mtp(0, hidden[:, :13], next_ids[:, :13], cache=cache)]
        for i in range(13, SEQ - 1):
            step = slice(i, i + 1)
            parts.append(model.mtp(0, hidden[:, step], next_ids[:, step], None, torch.full((2, 1), i), cache))
    assert cache.get_seq_length(0) == SEQ - 1
    assert relative_error(torch.cat(parts, dim=1), whole) < 1e-5


def test_crop_rolls_the_mtp_cache_back(deepseek):
    model, ids = deepseek.model, deepseek.ids
    hidden, next_ids = trunk_hidden(model, ids)[:, :-1], ids[:, 1:]
    with torch.no_grad():
        cache = model.mtp.new_cache()
        model.mtp(0, hidden[:, :20], next_ids[:, :20], cache=cache)
        first = model.mtp(0, hidden[:, 20:26], next_ids[:, 20:26], cache=cache)
        # a rejected draft continuation: other tokens at 26..29, then rolled back
        wrong = (next_ids[:, 26:30] + 1) % model.config.vocab_size
        model.mtp(0, hidden[:, 26:30], wrong, cache=cache)
        cache.crop(-4)
        assert cache.get_seq_length(0) == 26
        rest = model.mtp(0, hidden[:, 26:], next_ids[:, 26:], cache=cache)
        cache.crop(20)
        again = model.mtp(0, hidden[:, 20:26], next_ids[:, 20:26], cache=cache)
        whole = model.mtp(0, hidden, next_ids)
    assert relative_error(torch.cat([first, rest], dim=1), whole[:, 20:]) < 1e-5
    assert torch.equal(again, first)
    with pytest.raises(ValueError, match="cannot crop MTP layer 0"):
        cache.crop(-100)


def test_left_padded_rows_give_their_unpadded_outputs(deepseek):
    model, ids = deepseek.model, deepseek.ids
    pad = 5
    short = ids[1:, : SEQ - pad]
    padded = torch.cat([torch.zeros(1, pad, dtype=ids.dtype), short], dim=1)
    batch = torch.cat([ids[:1], padded])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = model.model(batch, attention_mask=mask, position_ids=positions).last_hidden_state
        cache = model.mtp.new_cache()
        out = model.mtp(0, hidden[:, :-1], batch[:, 1:], mask[:, :-1], positions[:, :-1], cache=cache)
        alone = model.mtp(0, trunk_hidden(model, short)[:, :-1], short[:, 1:])
        first_row = model.mtp(0, trunk_hidden(model, ids[:1])[:, :-1], ids[:1, 1:])
    assert relative_error(out[1, pad:], alone[0]) < 1e-5
    assert relative_error(out[0], first_row[0]) < 1e-5


def test_native_save_reloads_the_mtp_layer(deepseek, tmp_path):
    model = deepseek.model
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    mtp_names = sorted(name for name in saved if name.startswith("mtp."))
    assert "mtp.layers.0.eh_proj.weight" in mtp_names and "mtp.layers.0.shared_head.norm.weight" in mtp_names
    assert not any(name.endswith(("shared_head.head.weight", "embed_tokens.weight")) for name in mtp_names)
    assert json.loads((tmp_path / "config.json").read_text())["num_mtp_layers"] == 1
    reloaded = KDSAForCausalLM.from_pretrained(tmp_path).eval()
    assert set(reloaded.state_dict()) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    # shared, not copied: the MTP reads the reloaded model's own lm_head
    assert reloaded.mtp._target is reloaded


def test_native_checkpoint_missing_mtp_tensors_is_refused_by_name(deepseek, tmp_path):
    deepseek.model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["mtp.layers.0.block.self_attn.o_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mtp\.layers\.0\.block\.self_attn\.o_proj\.weight"):
        KDSAForCausalLM.from_pretrained(tmp_path)
    assert KDSAForCausalLM.from_pretrained(tmp_path, num_mtp_layers=0).mtp is None


@pytest.mark.slow
def test_saved_folder_reloads_the_mtp_layer_by_remote_code(deepseek, tmp_path):
    """A saved folder loads with trust_remote_code=True in a fresh process that cannot import this package
    (conftest.run_without_the_package), and its MTP layer gives the in-process logits."""
    model, ids = deepseek.model, deepseek.ids
    model.save_pretrained(tmp_path / "ckpt")
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        with torch.no_grad():
            hidden = model.model(ids).last_hidden_state
            torch.save(model.mtp.logits(0, model.mtp(0, hidden[:, :-1], ids[:, 1:])), {str(tmp_path / "out.pt")!r})
        """
    )
    result = run_without_the_package(script, cwd=tmp_path, HF_MODULES_CACHE=tmp_path / "modules")
    assert result.returncode == 0, result.stderr[-3000:]
    hidden = trunk_hidden(model, ids)
    with torch.no_grad():
        expected = model.mtp.logits(0, model.mtp(0, hidden[:, :-1], ids[:, 1:]))
    assert relative_error(torch.load(tmp_path / "out.pt"), expected) < 1e-6


# ------------------------------------------------------------------------------------------------- native config


def tiny_config(**changes) -> KDSAConfig:
    fields = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        linear_num_heads=2, linear_head_dim=16, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, num_mtp_layers=2,
    )  # fmt: skip
    return KDSAConfig(**(fields | changes))


def test_mtp_config_is_an_attention_and_moe_block_on_the_plain_residual():
    config = tiny_config(attn_res_block_size=4, first_k_dense_replace=2)
    mtp = config.mtp_config()
    assert mtp.num_hidden_layers == 2 and mtp.num_mtp_layers == 0
    assert mtp.layer_types == ["indexed_attention"] * 2 and mtp.mlp_layer_types == ["sparse"] * 2
    assert (mtp.attn_res_block_size, mtp.hc_mult, mtp.first_k_dense_replace) == (0, 1, 0)
    assert (mtp.index_topk, mtp.index_head_dim, mtp.hidden_size) == (4, 16, 32)
    kimi_like = tiny_config(layer_types=["linear_attention"] * 3 + ["full_attention"])
    assert kimi_like.mtp_config().layer_types == ["full_attention"] * 2
    with pytest.raises(ValueError, match="KDA layers only"):
        tiny_config(layer_types=["linear_attention"] * 4).mtp_config()


def test_negative_num_mtp_layers_is_refused_by_name():
    with pytest.raises(ValueError, match="num_mtp_layers"):
        tiny_config(num_mtp_layers=-1)


def test_model_forward_ignores_the_mtp_layers_and_init_covers_them():
    torch.manual_seed(0)
    with_mtp = KDSAForCausalLM(tiny_config()).eval()
    without = KDSAForCausalLM(tiny_config(num_mtp_layers=0)).eval()
    trunk = {k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")}
    without.load_state_dict(trunk)
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        assert torch.equal(with_mtp(ids).logits, without(ids).logits)
    assert isinstance(with_mtp.mtp, KDSAMultiTokenPredictor) and len(with_mtp.mtp.layers) == 2
    assert without.mtp is None
    # transformers' init ran over the MTP layers: unit norms, the KDSA router init, no NaN / uninitialised memory
    mtp_state = {k: v for k, v in with_mtp.state_dict().items() if k.startswith("mtp.")}
    assert torch.equal(mtp_state["mtp.layers.1.enorm.weight"], torch.ones(32))
    assert torch.equal(mtp_state["mtp.layers.0.block.mlp.gate.e_score_correction_bias"], torch.zeros(4))
    assert 0.01 < float(mtp_state["mtp.layers.0.eh_proj.weight"].std()) < 0.03
    assert all(torch.isfinite(v).all() for v in mtp_state.values())


def test_chained_layers_keep_their_own_token_counts_and_bad_calls_are_refused():
    torch.manual_seed(0)
    model = KDSAForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        cache = model.mtp.new_cache()
        first = model.mtp(0, hidden[:, :-1], ids[:, 1:], cache=cache)
        model.mtp(1, first[:, :-1], ids[:, 2:], cache=cache)  # layer 1 sees one pair fewer
        assert (cache.get_seq_length(0), cache.get_seq_length(1)) == (8, 7)
        cache.crop(-2)
        assert (cache.get_seq_length(0), cache.get_seq_length(1)) == (6, 5)
        cache.crop(3, layer_idx=1)
        assert (cache.get_seq_length(0), cache.get_seq_length(1)) == (6, 3)
        with pytest.raises(ValueError, match="MTP layer 2 does not exist"):
            model.mtp(2, hidden, ids)
        with pytest.raises(ValueError, match="KDSAMTPCache"):
            model.mtp(0, hidden, ids, cache=model.model(ids).cache)
        with pytest.raises(ValueError, match="attention_mask"):
            model.mtp(0, hidden[:, :2], ids[:, :2], torch.ones(1, 3), cache=cache)
        assert cache.get_seq_length(0) == 6  # a refused call writes nothing
        with pytest.raises(ValueError, match="vocab_size"):
            model.mtp(0, hidden, ids + 64)


def test_mtp_cache_capacity_is_per_layer_and_a_refused_write_keeps_the_pages():
    """`max_cache_tokens` bounds each MTP layer's own count: layer 1 may still take pairs once layer 0 is full."""
    torch.manual_seed(0)
    model = KDSAForCausalLM(tiny_config()).eval()
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        cache = KDSAMTPCache(model.config.mtp_config(), max_cache_tokens=7)
        first = model.mtp(0, hidden[:, :7], ids[:, 1:8], cache=cache)
        with pytest.raises(ValueError, match="capacity exceeded: 7 cached.*MTP layer 0 still holds 7 tokens"):
            model.mtp(0, hidden[:, 7:8], ids[:, 8:9], cache=cache)
        assert cache.get_seq_length(0) == 7
        model.mtp(1, first[:, :6], ids[:, 2:8], cache=cache)
        assert cache.get_seq_length(1) == 6


def test_train_mtp_writes_only_the_mtp_tensors_and_keeps_the_others_bit_identical(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from train_mtp import build_mtp, write_checkpoint

    torch.manual_seed(0)
    KDSAForCausalLM(tiny_config(num_mtp_layers=0)).save_pretrained(tmp_path)
    before = load_file(tmp_path / "model.safetensors")
    config_before = json.loads((tmp_path / "config.json").read_text())
    target = KDSAForCausalLM.from_pretrained(tmp_path).eval()
    build_mtp(target)  # block = the trunk's layer 3 (DSA + MoE), eh_proj = [I | I]
    block = target.mtp.layers[0].block
    assert torch.equal(block.self_attn.kv_b_proj.weight, before["model.layers.3.self_attn.kv_b_proj.weight"])
    written = write_checkpoint(target, tmp_path)
    after = load_file(tmp_path / "model.safetensors")
    assert set(after) == set(before) | set(written) and all(name.startswith("mtp.") for name in written)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    config_after = json.loads((tmp_path / "config.json").read_text())
    assert config_after == config_before | {"num_mtp_layers": 1}
    reloaded = KDSAForCausalLM.from_pretrained(tmp_path)
    for name, tensor in target.mtp.state_dict().items():
        assert torch.equal(reloaded.mtp.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="already holds MTP tensors"):
        write_checkpoint(target, tmp_path)
