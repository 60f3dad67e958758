"""The decoder layer: a token mixer (KDA, DSA or dense MLA) and a feed-forward (dense MLP or MoE) on a residual
stream, and the compile regions a static-cache decode step runs them as (docs/design.md §2, docs/graph-mode.md §8).
The model (modeling_kdsa.py) stacks these layers; the MTP block (mtp.py) is one of them."""

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from .attn_res import BlockAttnResStream, KDSADepthAttention
from .cache import KDSACache
from .configuration_kdsa import DSA_LAYER, KDA_LAYER, KDSAConfig
from .dsa import KDSAMultiLatentAttention, KDSASparseAttention
from .hyper_connections import HyperConnectionStream, KDSAHyperConnection
from .kda import KDSAKimiDeltaAttention
from .moe import KDSAMLP, KDSAMoE
from .norms import KDSARMSNorm
from .sequence_parallel import SequenceParallelContext
from .static_cache import KDSAStaticCache, StaticKDALayer, append_conv_window


class PlainResidualStream:
    """The standard pre-norm residual `h ← h + f(norm(h))`, with the same interface as `BlockAttnResStream`
    so that the decoder layer does not care which one it runs on (`attn_res_block_size = 0`)."""

    def __init__(self, embeddings: torch.Tensor):
        self.hidden_states = embeddings

    def input_for(self, sublayer_idx: int) -> torch.Tensor:
        return self.hidden_states

    def add_output(self, sublayer_idx: int, output: torch.Tensor) -> None:
        self.hidden_states = self.hidden_states + output

    def final(self, depth_attention: KDSADepthAttention | None = None) -> torch.Tensor:
        return self.hidden_states

    def copy(self) -> "PlainResidualStream":
        return PlainResidualStream(self.hidden_states)


class _KDAStateView:
    """One KDA layer's two state tensors behind the cache methods the KDA mixer calls, for a compile region
    (docs/graph-mode.md §8). dynamo stamps a traced region out for the next call only when it can match the inputs
    (modules, tensors, constants), so the region takes these tensors, not the cache object; the mixer's `layer_idx`
    comes here and is ignored. The updates are the in-place `copy_`s of `StaticKDALayer`."""

    def __init__(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor):
        self.conv_state, self.recurrent_state = conv_state, recurrent_state

    def has_previous_state(self, layer_idx: int) -> bool:
        return True

    def get_conv_state(self, layer_idx: int) -> torch.Tensor:
        return self.conv_state

    def get_recurrent_state(self, layer_idx: int) -> torch.Tensor:
        return self.recurrent_state

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, **kwargs) -> None:
        append_conv_window(self.conv_state, conv_states)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int) -> None:
        self.recurrent_state.copy_(recurrent_states)


@torch.compiler.nested_compile_region
def _kda_sublayer(
    layer: "KDSADecoderLayer",
    layer_input: torch.Tensor,
    token_mask: torch.Tensor | None,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
) -> torch.Tensor:
    """Norm + KDA mixer of one decode step on a static cache, as one compile region: traced and compiled once,
    stamped out for every KDA layer (docs/graph-mode.md §8). Eager: a plain call."""
    hidden_states = layer.input_layernorm(layer_input)
    return layer.linear_attn(hidden_states, attention_mask=token_mask, cache=_KDAStateView(conv_state, recurrent_state))


@torch.compiler.nested_compile_region
def _attention_sublayer(
    layer: "KDSADecoderLayer",
    layer_input: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    attention_mask: torch.Tensor | None,
    cache: KDSAStaticCache,
    topk_indices: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Norm + DSA / dense MLA mixer as one compile region (docs/graph-mode.md §8). It takes the cache object, so
    dynamo traces it per layer (the object is no region input it can match), but the traced bodies are identical:
    dynamo installs one body per kind and inductor compiles it once."""
    return layer._attention(layer_input, position_embeddings, attention_mask, cache, topk_indices)


@torch.compiler.nested_compile_region
def _feed_forward_sublayer(layer: "KDSADecoderLayer", mlp_input: torch.Tensor) -> torch.Tensor:
    """Norm + MLP / MoE as one compile region, compiled once per feed-forward kind (docs/graph-mode.md §8)."""
    return layer.mlp(layer.post_attention_layernorm(mlp_input))


class KDSADecoderLayer(GradientCheckpointingLayer):
    """One layer = two sublayers: a token mixer (KDA, DSA or dense MLA) and a feed-forward (dense MLP or MoE)."""

    def __init__(self, config: KDSAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        # Distinct attribute names per mixer so tensor-parallel plans never hit the wrong one.
        if self.layer_type == KDA_LAYER:
            self.linear_attn = KDSAKimiDeltaAttention(config, layer_idx)
        elif self.layer_type == DSA_LAYER:
            self.self_attn = KDSASparseAttention(config, layer_idx)
        else:
            self.self_attn = KDSAMultiLatentAttention(config, layer_idx)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = KDSAMoE(config)
        else:
            self.mlp = KDSAMLP(config)
        self.input_layernorm = KDSARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KDSARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.attn_res_block_size > 0:
            self.attention_res = KDSADepthAttention(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_res = KDSADepthAttention(config.hidden_size, eps=config.rms_norm_eps)
        # The next layer reuses this layer's top-k (indexer_types; the config allows it only after a full DSA layer).
        next_idx = layer_idx + 1
        self.hands_over_topk = next_idx < config.num_hidden_layers and (
            config.layer_types[next_idx] == DSA_LAYER and config.indexer_types[next_idx] == "shared"
        )
        if config.hc_mult > 1:
            self.attn_hc = KDSAHyperConnection(config)
            self.ffn_hc = KDSAHyperConnection(config)

    def forward(
        self,
        stream: PlainResidualStream | BlockAttnResStream | HyperConnectionStream,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        cache: KDSACache | None,
        topk_indices: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        output_router_logits: bool = False,
        sequence_parallel: SequenceParallelContext | None = None,
    ) -> tuple[
        PlainResidualStream | BlockAttnResStream | HyperConnectionStream,
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor | None,
    ]:
        """Advance `stream` by this layer's two sublayers. `attention_mask`: 2-D `[B, S]` padding mask over all keys
        (past + current; with a `KDSAStaticCache`, `[B, capacity]`) or None when nothing is padded. `topk_indices`:
        the previous layer's DSA selection, for a shared-indexer layer. `token_mask`: `[B, T]`, the mask of the current
        tokens (default: the last T columns of `attention_mask`). `sequence_parallel`: handed to the token mixer
        (docs/parallel.md §7).

        Returns `(stream, layer_input, handed_over, router_logits)`: the advanced stream (the same object, or under
        gradient checkpointing an advanced copy), the stream value this layer read (its token mixer's input before
        the norm: the layer's entry in `output_hidden_states`), this layer's selection when the next layer shares it
        (else None), and with `output_router_logits` the MoE router logits `[B·T, E]` (None for a dense MLP)."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # The backward pass replays this forward from the stream object it was given: leave that one untouched
            # and advance a copy (docs/design.md §10).
            stream = stream.copy()
        attn_idx, mlp_idx = 2 * self.layer_idx, 2 * self.layer_idx + 1
        layer_input = stream.input_for(attn_idx)
        # Compiling a step on a static cache: the sublayers run as compile regions, so that inductor compiles each
        # distinct body once, not once per layer (docs/graph-mode.md §8).
        regions = torch.compiler.is_compiling() and isinstance(cache, KDSAStaticCache) and sequence_parallel is None
        if regions:
            # A region's traced body is reused for the next layer only if the inputs' strides match; a stream may hand
            # out a strided view (Block AttnRes: a slice of the block statistics).
            layer_input = layer_input.contiguous()
        if self.layer_type == KDA_LAYER:
            # KDA only needs to know which of the current tokens are padding.
            current_mask = token_mask
            if current_mask is None and attention_mask is not None:
                current_mask = attention_mask[:, -layer_input.shape[1] :]
            state = cache.layers[self.layer_idx] if regions else None
            if isinstance(state, StaticKDALayer) and state.has_previous_state[0]:
                mixed = _kda_sublayer(self, layer_input, current_mask, state.conv_states[0], state.recurrent_states[0])
            else:
                mixed = self.linear_attn(
                    self.input_layernorm(layer_input),
                    attention_mask=current_mask,
                    cache=cache,
                    sequence_parallel=sequence_parallel,
                )
        else:
            # The model's RoPE table may exist for other layers (a DSA indexer) while this one rotates nothing.
            if not self.self_attn.uses_position_embeddings:
                position_embeddings = None
            if self.layer_type != DSA_LAYER or not self.self_attn.shares_indexer:
                topk_indices = None
            if regions and getattr(cache.layers[self.layer_idx], "is_initialized", False):
                mixed = _attention_sublayer(self, layer_input, position_embeddings, attention_mask, cache, topk_indices)
            else:
                mixed = self._attention(
                    layer_input, position_embeddings, attention_mask, cache, topk_indices, sequence_parallel
                )
        handed_over = None
        if self.hands_over_topk:
            mixed, handed_over = mixed
        stream.add_output(attn_idx, mixed)
        router_logits = None
        if output_router_logits and isinstance(self.mlp, KDSAMoE):
            hidden_states = self.post_attention_layernorm(stream.input_for(mlp_idx))
            mlp_output, router_logits = self.mlp(hidden_states, output_router_logits=True)
        elif regions:
            mlp_output = _feed_forward_sublayer(self, stream.input_for(mlp_idx).contiguous())
        else:
            mlp_output = self.mlp(self.post_attention_layernorm(stream.input_for(mlp_idx)))
        stream.add_output(mlp_idx, mlp_output)
        return stream, layer_input, handed_over, router_logits

    def _attention(
        self,
        layer_input: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        cache: KDSACache | None,
        topk_indices: torch.Tensor | None,
        sequence_parallel: SequenceParallelContext | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Norm + DSA / dense MLA mixer; with `hands_over_topk`, also this layer's selection."""
        selection = {}  # a DSA layer takes or hands over a top-k selection (docs/dsa.md §10)
        if self.layer_type == DSA_LAYER:
            selection = {"topk_indices": topk_indices, "return_topk_indices": self.hands_over_topk}
        return self.self_attn(
            self.input_layernorm(layer_input),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            sequence_parallel=sequence_parallel,
            **selection,
        )
