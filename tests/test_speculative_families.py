"""Greedy MTP and greedy DSpark return plain greedy's tokens on every family fixture (tiny hub folders of
DeepSeek-V3.2, Kimi-Linear and GLM-5.3-Flash loaded through the converter, and a Kimi K3 folder with MXFP4 experts),
at batch 1 and batch 4 left-padded, 32 steps. MTP runs where the family ships MTP layers (DeepSeek-V3.2 and
GLM-5.3-Flash: their folders here carry one); DSpark runs with a random draft bound to each target."""

import pytest
import torch
from conftest import left_padded_batch, needs_kernel_build, verify_and_steps_logits
from test_foreign_checkpoints import MTP_PREFIX, family, with_mtp  # noqa: F401  (family: a module fixture)
from test_kimi_k3 import k3_config, k3_raw_config, perturbed_model, write_k3_folder

from modeling_kdsa import DSparkConfig, DSparkDraftModel, KDSAForCausalLM, speculative

STEPS = 32
GREEDY = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, pad_token_id=0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def every_round_drafts(monkeypatch):
    """These tests check the drafting mechanics round by round: every round drafts (test_draft_schedule.py tests
    the adaptive schedule)."""
    monkeypatch.setattr(speculative, "DEFAULT_DRAFT_SCHEDULE", "always")


def prompts(batch: int, vocab: int):
    ids, mask = left_padded_batch([19, 7, 26, 12][:batch], vocab=vocab, seed=11)
    return ids, (mask if batch > 1 else None)


def random_dspark(target) -> DSparkDraftModel:
    config = target.config
    torch.manual_seed(0)
    layers = config.num_hidden_layers
    draft = DSparkDraftModel(DSparkConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=2 * config.hidden_size,
        num_hidden_layers=1, num_attention_heads=4, target_layer_ids=sorted({0, layers // 2, layers - 2}),
        num_target_layers=layers, block_size=4, mask_token_id=3, markov_rank=16,
    ))  # fmt: skip
    return draft.to(next(target.parameters()).dtype).eval()


def assert_speculative_equals_plain(model, batch: int, **extra):
    ids, mask = prompts(batch, model.config.vocab_size)
    reference = model.generate(ids, attention_mask=mask, **GREEDY)
    out = model.generate(ids, attention_mask=mask, **GREEDY, **extra)
    assert torch.equal(out, reference)
    assert model.speculation_stats.rounds > 0


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_mtp_greedy_on_family_fixtures(family, tmp_path, batch):  # noqa: F811
    if family.name not in MTP_PREFIX:
        pytest.skip(f"{family.name} checkpoints have no multi-token-prediction layers")
    folder, _ = with_mtp(family, tmp_path)
    model = KDSAForCausalLM.from_pretrained(folder).eval()
    assert_speculative_equals_plain(model, batch, use_mtp=True, mtp_draft_tokens=2)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_dspark_greedy_on_family_fixtures(family, batch):  # noqa: F811
    assert_speculative_equals_plain(family.model, batch, assistant_model=random_dspark(family.model),
                                    speculation_type="dspark", dspark_confidence_threshold=0.0)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_dspark_greedy_on_kimi_k3_with_mxfp4_experts(tmp_path, batch):
    folder = tmp_path / "Kimi-K3-tiny"
    write_k3_folder(folder, perturbed_model(k3_config()), k3_raw_config())
    model = KDSAForCausalLM.from_pretrained(folder).eval()
    assert_speculative_equals_plain(model, batch, assistant_model=random_dspark(model), speculation_type="dspark",
                                    dspark_confidence_threshold=0.0)  # fmt: skip


@needs_kernel_build
def test_bf16_verify_forward_has_the_bits_of_one_token_steps(family):  # noqa: F811
    """In bf16 on the `cpu` backend a forward of 8 tokens from a cache gives each token the logits of its one-token
    step, bit for bit, on each family's layout (docs/speculative.md §2): so greedy speculative output is plain
    greedy's in bf16 too."""
    model = KDSAForCausalLM.from_pretrained(family.folder, dtype=torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, model.config.vocab_size, (2, 40), generator=generator)
    new = torch.randint(4, model.config.vocab_size, (2, 8), generator=generator)
    verify, steps = verify_and_steps_logits(model, prompt, new)
    assert torch.equal(verify, steps)
