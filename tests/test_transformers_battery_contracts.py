"""Contracts found by running transformers' shared causal-LM test battery against KDSA (docs/testing.md §6); each
test here failed before its fix."""

import pytest
from conftest import tiny_config

from modeling_kdsa import KDSAForCausalLM


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_tied_head_and_embedding_have_the_same_tensor_parallel_style(tie_word_embeddings):
    """A tied `lm_head` is the embedding's parameter: the TP plan names both or neither, and both styles cut that
    tensor the same way, by vocabulary rows (`Shard(0)` of the same `[V, D]` weight, docs/parallel.md §5): the
    embedding's style all-reduces its lookups, the head's all-gathers its logits."""
    from modeling_kdsa.parallel.tensor_parallel import embedding_shard_plan, lm_head_shard_plan

    model = KDSAForCausalLM(tiny_config(tie_word_embeddings=tie_word_embeddings))
    plan = model.tp_plan
    assert (plan.get("model.embed_tokens"), plan.get("lm_head")) == ("kdsa_vocab_embedding", "kdsa_vocab_head")
    (embed_cut,) = embedding_shard_plan(model.model.embed_tokens).cuts
    (head_cut,) = lm_head_shard_plan(model.lm_head).cuts
    assert (embed_cut.name, embed_cut.placement(), embed_cut.vocab) == (head_cut.name, head_cut.placement(), 128)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie_word_embeddings
    assert ("lm_head.weight" in model._tied_weights_keys) and model._tied_weights_keys["lm_head.weight"] == (
        "model.embed_tokens.weight"
    )
