"""The checks `KDSAModel.forward` runs on its arguments before any layer: each refuses what the model cannot compute
with a `ValueError` that names the argument, instead of an error deep inside a layer or a silently wrong output."""

import torch

from .cache import KDSACache, KDSACacheMixin
from .configuration_kdsa import KDSAConfig
from .static_cache import KDSAStaticCache


def check_forward_inputs(
    config: KDSAConfig,
    input_ids: torch.LongTensor | None,
    inputs_embeds: torch.Tensor | None,
    cache,
    output_attentions: bool | None,
    output_router_logits: bool,
) -> None:
    """The arguments of `KDSAModel.forward` before the embedding lookup: outputs the model cannot form, exactly one
    of `input_ids` / `inputs_embeds`, ids inside the vocabulary, and a cache of KDSA's kind."""
    if output_router_logits and "sparse" not in config.mlp_layer_types:
        raise ValueError(
            "output_router_logits=True but the model has no MoE layer (mlp_layer_types has no 'sparse' entry): "
            "there are no router logits"
        )
    if output_attentions:
        raise ValueError(
            "output_attentions=True is not supported: KDA layers are linear attention (no attention matrix) and "
            "DSA layers attend to index_topk selected keys per query without forming the [T, S] matrix"
        )
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids or inputs_embeds")
    if input_ids is not None:
        # One host sync per forward (eager only: a compiled graph must not branch on data).
        out_of_vocab = not torch.compiler.is_compiling() and bool(
            ((input_ids < 0) | (input_ids >= config.vocab_size)).any()
        )
        if out_of_vocab:
            raise ValueError(
                f"input_ids must lie in [0, vocab_size={config.vocab_size}); got ids from "
                f"{int(input_ids.min())} to {int(input_ids.max())}"
            )
    if cache is not None and not isinstance(cache, KDSACacheMixin):
        raise ValueError(
            f"KDSA models need a KDSACache or a KDSAStaticCache (paged DSA store, KDA states); got "
            f"{type(cache).__name__}. "
            "Pass `KDSACache(model.config)` or let generate() create it"
        )


def check_input_embeddings(inputs_embeds: torch.Tensor, cache: KDSACache | None) -> None:
    """The embedded input: `[batch, seq, hidden]` with at least one token."""
    if inputs_embeds.dim() != 3:
        raise ValueError(f"inputs_embeds must be [batch, seq, hidden], got shape {tuple(inputs_embeds.shape)}")
    if inputs_embeds.shape[1] == 0:
        past_tokens = int(cache.get_seq_length()) if cache is not None else 0
        raise ValueError(
            "input has no tokens (sequence length 0)"
            + (
                f"; the cache already holds {past_tokens} tokens: generate() feeds the model only the tokens after "
                "the cached ones, so a used KDSACache needs a prompt that extends them (or pass a fresh "
                "KDSACache, or call cache.reset())"
                if past_tokens
                else ""
            )
        )


def check_sequence_parallel(sequence_parallel, local_len: int, attention_mask, position_ids, cache) -> None:
    """What a sequence-parallel forward cannot take (docs/parallel.md §7): it starts a sequence without padding."""
    if sequence_parallel.positions.numel() != local_len:
        raise ValueError(
            f"sequence_parallel holds {sequence_parallel.positions.numel()} local tokens, the input has {local_len}"
        )
    if attention_mask is not None or position_ids is not None:
        raise ValueError(
            "sequence_parallel takes no attention_mask or position_ids: positions and padding slots come from it"
        )
    if isinstance(cache, KDSAStaticCache) or (cache is not None and cache.get_seq_length() != 0):
        raise ValueError(
            "sequence_parallel needs an empty KDSACache or none (it starts a sequence; the fixed-capacity "
            "KDSAStaticCache is not supported)"
        )


def padding_mask(attention_mask: torch.Tensor | None, batch_size: int, total_len: int) -> torch.Tensor | None:
    """Validate the 2-D padding mask `[B, past + T]`; return it as bool, or None when nothing is padded."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"KDSA takes a 2-D padding mask [batch, past + new tokens]; got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask.shape != (batch_size, total_len):
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match [batch={batch_size}, "
            f"past + new tokens={total_len}]"
        )
    attention_mask = attention_mask.bool()
    if torch.compiler.is_compiling():
        # `all()` would be a host sync and a data-dependent branch: a compiled forward keeps the mask (an all-True
        # mask changes no value; docs/graph-mode.md §1).
        return attention_mask
    return None if bool(attention_mask.all()) else attention_mask
