"""Multi-token-prediction (MTP) layers: DeepSeek-V3's "next-n" draft layers on a KDSA trunk (DeepSeek-V3 technical
report, arXiv 2412.19437 §2.2; docs/checkpoint-conversion.md §10).

MTP layer k turns the pair (h_i, t_{i+1}) into a prediction of t_{i+2}:

    h'_i  = eh_proj([enorm(emb(t_{i+1})) ; hnorm(h_i)])        eh_proj: Linear(2H -> H), no bias
    b_i   = block(h'_i)                                          one attention + MoE decoder layer (`mtp_config()`)
    logits = lm_head(shared_head.norm(b_i))

`emb` and `lm_head` are the model's own (shared, never copied). For layer 0, h_i is the trunk's final normed hidden
state (`last_hidden_state`); a chained draft (layer k > 0, or a layer reused on its own output) feeds the previous
block output `b_i` before its norm. The pair (h_i, t_{i+1}) sits at position i. The block is a `KDSADecoderLayer` of
the MTP configuration (DSA with the trunk's indexer, or dense MLA for a trunk without DSA layers) with its own cache
store per layer (`KDSAMTPCache`): its pages are cropped like the trunk's, exactly.
"""

import torch
from torch import nn
from transformers.cache_utils import Cache

from .cache import KDSACache, attention_store_class
from .configuration_kdsa import KDSAConfig
from .decoder_layer import KDSADecoderLayer, PlainResidualStream
from .linear import KDSALinear
from .modeling_validation import padding_mask
from .norms import KDSARMSNorm
from .rotary import KDSARotaryEmbedding


class KDSAMTPCache(KDSACache):
    """The cache of the MTP layers: one paged attention store per MTP layer (layer k's store is `layers[k]`). Unlike
    the trunk's `KDSACache`, each layer counts its own tokens: a chain of MTP layers may feed layer k fewer pairs than
    layer 0. `get_seq_length(k)`, `begin_forward(..., layer_idx=k)` and `crop(max_length, layer_idx=None)` take the
    layer. The stores are attention pages only, so `crop` is exact with no replay records (`rollback_tokens` is
    accepted for the trunk cache's signature and has nothing to record)."""

    def __init__(self, mtp_config: KDSAConfig, rollback_tokens: int = 0, max_cache_tokens: int | None = None):
        if rollback_tokens < 0:
            raise ValueError(f"rollback_tokens must be >= 0, got {rollback_tokens}")
        if max_cache_tokens is not None and max_cache_tokens <= 0:
            raise ValueError(f"max_cache_tokens must be > 0 or None, got {max_cache_tokens}")
        # Cache.__init__, not KDSACache's: the token count is per layer (the stores' own), not one shared counter.
        Cache.__init__(
            self,
            layers=[
                attention_store_class(mtp_config, k).from_config(mtp_config) for k in range(len(mtp_config.layer_types))
            ],
        )
        self.max_cache_tokens = max_cache_tokens
        self.rollback_tokens = rollback_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens of MTP layer 0 (what `KDSACache` callers read as the cache length)."""
        return self.get_seq_length(0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].num_tokens

    def begin_forward(self, new_tokens: int, like: torch.Tensor | None = None, layer_idx: int = 0) -> int:
        """Called before MTP layer `layer_idx` runs on `new_tokens` pairs: capacity check and page reservation of
        that layer's store. Returns the pairs it held before."""
        store = self.layers[layer_idx]
        past = store.num_tokens
        self._check_capacity(past, new_tokens, holder=f"MTP layer {layer_idx}")
        if like is not None:
            store.reserve(new_tokens, like)
        return past

    @property
    def is_croppable(self) -> bool:
        return True

    def crop(self, max_length: int, layer_idx: int | None = None) -> None:
        """`max_length > 0`: keep at most that many tokens in each layer (or in `layer_idx` only); `<= 0`: drop
        `-max_length` tokens from each. Checked for every layer before any changes."""
        indices = range(len(self.layers)) if layer_idx is None else [layer_idx]
        targets = {}
        for i in indices:
            held = self.layers[i].num_tokens
            new_length = held + max_length if max_length <= 0 else min(max_length, held)
            if new_length < 0:
                raise ValueError(f"cannot crop MTP layer {i} holding {held} tokens by {-max_length}")
            targets[i] = new_length
        for i, new_length in targets.items():
            self.layers[i].crop(new_length)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()


class KDSAMTPSharedHead(nn.Module):
    """DeepSeek's `shared_head` of an MTP layer without its `head`: the final norm; the projection is the model's
    `lm_head`."""

    def __init__(self, config: KDSAConfig):
        super().__init__()
        self.norm = KDSARMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class KDSAMTPLayer(nn.Module):
    """One MTP layer: `enorm`, `hnorm`, `eh_proj` (`[H, 2H]`, input order [embedding ; hidden]), the decoder block
    `block` (a `KDSADecoderLayer` of `mtp_config`, layer index `layer_idx`) and `shared_head.norm`."""

    def __init__(self, mtp_config: KDSAConfig, layer_idx: int):
        super().__init__()
        hidden = mtp_config.hidden_size
        self.enorm = KDSARMSNorm(hidden, eps=mtp_config.rms_norm_eps)
        self.hnorm = KDSARMSNorm(hidden, eps=mtp_config.rms_norm_eps)
        self.eh_proj = KDSALinear(2 * hidden, hidden, bias=False, kernel_backend=mtp_config.kernel_backend)
        self.block = KDSADecoderLayer(mtp_config, layer_idx)
        self.shared_head = KDSAMTPSharedHead(mtp_config)


class KDSAMultiTokenPredictor(nn.Module):
    """The `num_mtp_layers` MTP layers of a `KDSAForCausalLM` (`model.mtp`). The model's input embedding and
    `lm_head` are read from the model at each call (shared, not registered here: they are saved once, as the
    model's)."""

    def __init__(self, config: KDSAConfig):
        super().__init__()
        self.mtp_config = config.mtp_config()
        self.layers = nn.ModuleList(
            [KDSAMTPLayer(self.mtp_config, k) for k in range(self.mtp_config.num_hidden_layers)]
        )
        uses_rope = self.mtp_config.qk_rope_head_dim > 0 and any(
            layer.block.self_attn.uses_position_embeddings for layer in self.layers
        )
        self.rotary_emb = KDSARotaryEmbedding(self.mtp_config) if uses_rope else None
        self.__dict__["_target"] = None  # the owning KDSAForCausalLM, outside the module tree (`bind`)

    def bind(self, target: nn.Module) -> None:
        """Share `target`'s input embedding and `lm_head` (a `KDSAForCausalLM`)."""
        self.__dict__["_target"] = target

    def _shared(self) -> nn.Module:
        if self._target is None:
            raise ValueError(
                "this KDSAMultiTokenPredictor is not bound to a model (bind(model)): no embedding / lm_head"
            )
        return self._target

    def new_cache(self, rollback_tokens: int = 0) -> KDSAMTPCache:
        """An empty cache for the MTP layers (one paged store per layer)."""
        return KDSAMTPCache(self.mtp_config, rollback_tokens=rollback_tokens)

    def _check_layer(self, layer: int) -> KDSAMTPLayer:
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"MTP layer {layer} does not exist: the model has num_mtp_layers={len(self.layers)}")
        return self.layers[layer]

    def forward(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KDSAMTPCache | None = None,
    ) -> torch.Tensor:
        """MTP layer `layer` over T pairs: `hidden_states [B, T, D]` (h_i: the trunk's final normed states for layer
        0, a previous block output otherwise), `input_ids [B, T]` (t_{i+1}), `attention_mask [B, past + T]` (2-D, 1 =
        real; past = the pairs this layer's cache store holds) or None, `position_ids [B, T]` (i; default past ..
        past + T - 1), `cache` a `KDSAMTPCache` from `new_cache` or None (a forward over the whole sequence). Returns
        the block output `[B, T, D]` before the final norm (`logits` applies it)."""

        mtp_layer = self._check_layer(layer)
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.mtp_config.hidden_size:
            raise ValueError(
                f"hidden_states must be [batch, seq, hidden_size={self.mtp_config.hidden_size}], got "
                f"{tuple(hidden_states.shape)}"
            )
        if tuple(input_ids.shape) != tuple(hidden_states.shape[:2]):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} must be [batch, seq] of hidden_states {tuple(hidden_states.shape)}"
            )
        if cache is not None and not isinstance(cache, KDSAMTPCache):
            raise ValueError(f"cache must be a KDSAMTPCache (model.mtp.new_cache()), got {type(cache).__name__}")
        vocab = self.mtp_config.vocab_size
        if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
            raise ValueError(f"input_ids must lie in [0, vocab_size={vocab})")
        batch, seq_len = input_ids.shape
        embeddings = self._shared().get_input_embeddings()(input_ids)
        joined = torch.cat([mtp_layer.enorm(embeddings), mtp_layer.hnorm(hidden_states.to(embeddings.dtype))], dim=-1)
        projected = mtp_layer.eh_proj(joined)
        past = 0
        if cache is not None:
            past = cache.get_seq_length(layer)
            # Validated before any page is reserved (the DSA layer checks it again against its store).
            padding_mask(attention_mask, batch, past + seq_len)
            cache.begin_forward(seq_len, like=projected, layer_idx=layer)
        attention_mask = padding_mask(attention_mask, batch, past + seq_len)
        if position_ids is None:
            position_ids = (torch.arange(seq_len, device=projected.device) + past).unsqueeze(0).expand(batch, -1)
        position_embeddings = self.rotary_emb(projected, position_ids) if self.rotary_emb is not None else None
        stream, _, _, _ = mtp_layer.block(
            PlainResidualStream(projected),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
        )
        return stream.hidden_states

    def logits(self, layer: int, block_out: torch.Tensor) -> torch.Tensor:
        """`lm_head(shared_head.norm(block_out))`: `[B, T, D]` -> `[B, T, V]`, with the model's `lm_head`."""
        return self._shared().lm_head(self._check_layer(layer).shared_head.norm(block_out))


__all__ = ["KDSAMTPCache", "KDSAMTPLayer", "KDSAMultiTokenPredictor"]
