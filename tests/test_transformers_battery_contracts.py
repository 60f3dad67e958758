"""Contracts found by running transformers' shared causal-LM test battery against KDSA (docs/testing.md §6); each
test here failed before its fix."""

import pytest
from conftest import tiny_config

from modeling_kdsa import KDSAForCausalLM


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_tied_head_and_embedding_have_the_same_tensor_parallel_style(tie_word_embeddings):
    """A tied `lm_head` is the embedding's parameter: the TP plan names both or neither, with the same style. The
    embedding is kept whole ("replicate", so transformers does not shard it on the vocabulary), and so is the head."""
    model = KDSAForCausalLM(tiny_config(tie_word_embeddings=tie_word_embeddings))
    plan = model.tp_plan
    assert plan.get("lm_head") == plan.get("model.embed_tokens") == "replicate"
    assert ("lm_head.weight" in model._tied_weights_keys) and model._tied_weights_keys["lm_head.weight"] == (
        "model.embed_tokens.weight"
    )
