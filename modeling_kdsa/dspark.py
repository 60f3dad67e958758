"""DSpark draft models: a block drafter conditioned on the target's hidden states.

DSpark (DeepSeek, "DSpark" paper, github.com/deepseek-ai/DeepSpec) is a semi-autoregressive drafter. One forward of
a small Qwen3-style backbone over the block `[anchor, MASK × (γ−1)]` gives hidden states `h_0..h_{γ−1}` and base
logits `U_k = lm_head(h_k)`; slot k predicts the token at `p + k + 1` (anchor-first layout, `sample_from_anchor`). A
Markov head then adds a bias that depends on the previously drafted token, so the block is sampled left to right:
`logits_k = U_k + W2(W1[x_{k−1}])` (vanilla; `gated` and `rnn` variants below), and a confidence head scores
`σ(w·[h_k ; W1[x_{k−1}]] + b)`, the probability that slot k survives verification given that the slots before it did.

Context: the target's hidden states at `target_layer_ids` (0-based decoder layers whose *output* is used, i.e.
transformers' `hidden_states[id + 1]`) are concatenated on the feature axis and mapped by `fc` (no bias) and
`hidden_norm`. Every draft layer applies its own `k_proj` / `v_proj` / `k_norm` and RoPE to these context rows and
prepends them to the block's keys and values; queries come from the block only, which attends to every non-padding
context row of its sequence and to all of its own slots (no causal mask inside the block). `DSparkCache` keeps the
context K/V rows only; a block's own K/V are never stored.

Checkpoint formats:

- **speculators** (`speculators_model_type: "dspark"`, vLLM's `method: "dspark"`): `transformer_layer_config` is a
  Qwen3 config of the draft, `aux_hidden_state_layer_ids` are transformers `hidden_states` indices (= layer id + 1).
  With the full vocabulary the file holds neither `embed_tokens` nor `lm_head`: both come from the target
  (`bind_target`). A reduced vocabulary adds `lm_head.weight [V_draft, H]`, `d2t [V_draft]` (target id = draft id +
  d2t[draft id]) and `t2d [V_target]` (bool). `save_pretrained` writes this format.
- **DeepSpec** (`architectures: ["Qwen3DSparkModel"]`): the target's Qwen3 config plus `target_layer_ids`,
  `num_target_layers`, `block_size`, ...; the file holds its own `embed_tokens.weight` and `lm_head.weight`.

The `speculators` package itself is not a dependency: the field and tensor names follow its documented format
(`speculators/models/dspark/`, `speculators/models/dflash/`) and DeepSpec's `deepspec/modeling/dspark/qwen3/`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Qwen3Config

from .norms import KDSARMSNorm
from .rotary import apply_rotary_half

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
SPECULATORS_FORMAT, DEEPSPEC_FORMAT = "speculators", "deepspec"
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
SPECULATORS_ARCHITECTURE = "DSparkSpeculator"
# The speculators release whose DSpark format `save_pretrained` writes (the first with models/dspark/ is 0.7.0).
SPECULATORS_FORMAT_VERSION = "0.9.0"


class DSparkConfig(PretrainedConfig):
    """The draft's own description, whichever format it was read from.

    Backbone (Qwen3): `hidden_size`, `intermediate_size`, `num_hidden_layers` (draft depth), `num_attention_heads`,
    `num_key_value_heads`, `head_dim`, `rms_norm_eps`, `rope_theta` (plain RoPE only), `attention_bias`,
    `max_position_embeddings`. Vocabulary: `vocab_size` (the target's), `draft_vocab_size` (≤ `vocab_size`; smaller
    means a reduced vocabulary with `d2t` / `t2d`). Context: `target_layer_ids` (0-based target layers whose output
    is used), `target_hidden_size`, `num_target_layers` (None when the checkpoint does not say). Block:
    `block_size` (γ, slots per block, anchor included), `mask_token_id`. Heads: `markov_rank` (0 = no Markov head),
    `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`. `owns_embeddings`: the checkpoint
    carries `embed_tokens` and `lm_head` (DeepSpec form); otherwise `bind_target` shares the target's.
    """

    model_type = "kdsa_dspark"

    def __init__(
        self,
        vocab_size: int = 201,
        hidden_size: int = 128,
        intermediate_size: int = 256,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        attention_bias: bool = False,
        max_position_embeddings: int = 4096,
        initializer_range: float = 0.02,
        draft_vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        target_layer_ids: Sequence[int] = (0,),
        num_target_layers: int | None = None,
        block_size: int = 8,
        mask_token_id: int = 0,
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        owns_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = float(rope_theta)
        self.attention_bias = attention_bias
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.draft_vocab_size = vocab_size if draft_vocab_size is None else draft_vocab_size
        self.target_hidden_size = hidden_size if target_hidden_size is None else target_hidden_size
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.num_target_layers = num_target_layers
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.markov_rank = markov_rank
        self.markov_head_type = markov_head_type
        self.enable_confidence_head = enable_confidence_head
        self.confidence_head_with_markov = confidence_head_with_markov
        self.owns_embeddings = owns_embeddings
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.validate_dspark()

    @property
    def reduced_vocabulary(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @property
    def hidden_state_indices(self) -> list[int]:
        """transformers `hidden_states` indices of the context layers (speculators' `aux_hidden_state_layer_ids`)."""
        return [i + 1 for i in self.target_layer_ids]

    def validate_dspark(self) -> None:
        """Field checks that need no target; a `ValueError` names the field."""
        positive = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size",
                    "block_size")  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DSpark config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DSpark config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DSpark config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"DSpark config: draft_vocab_size={self.draft_vocab_size} exceeds the target vocab_size="
                f"{self.vocab_size}"
            )
        if self.reduced_vocabulary and self.owns_embeddings:
            raise ValueError("DSpark config: a reduced draft vocabulary (draft_vocab_size < vocab_size) with its own "
                             "embed_tokens is not a known format")  # fmt: skip
        if not self.target_layer_ids:
            raise ValueError("DSpark config: target_layer_ids is empty (the draft needs at least one target layer)")
        for layer_id in self.target_layer_ids:
            if layer_id < 0:
                raise ValueError(
                    f"DSpark config: target layer id {layer_id} is out of range (ids are 0-based decoder layers; "
                    "speculators' aux_hidden_state_layer_ids are these ids + 1)"
                )
            if self.num_target_layers is not None:
                check_target_layer_id(layer_id, self.num_target_layers)
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DSpark config: mask_token_id={self.mask_token_id!r} is not a token id of the vocabulary "
                f"(vocab_size={self.vocab_size})"
            )
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ValueError(f"DSpark config: markov_rank must be an integer >= 0, got {self.markov_rank!r}")
        if self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"DSpark config: markov_head_type={self.markov_head_type!r} is not one of {MARKOV_HEAD_TYPES}"
            )
        if self.enable_confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            raise ValueError("DSpark config: confidence_head_with_markov needs a Markov head (markov_rank > 0)")


def check_target_layer_id(layer_id: int, num_target_layers: int) -> None:
    """A context layer must be a decoder layer of the target other than the last: transformers replaces the last
    entry of `hidden_states` by the final normed state, so the last layer's raw output is not available."""
    if not 0 <= layer_id < num_target_layers:
        raise ValueError(
            f"DSpark target layer id {layer_id} is out of range for a target with {num_target_layers} layers "
            f"(valid: 0..{num_target_layers - 2})"
        )
    if layer_id == num_target_layers - 1:
        raise ValueError(
            f"DSpark target layer id {layer_id} is the target's final layer: its hidden_states entry is the final "
            f"normed state, not the layer's output (valid: 0..{num_target_layers - 2})"
        )


# ------------------------------------------------------------------------------------------------- cache


class DSparkCache:
    """Context K/V of every draft layer for a batch, plus which rows are real tokens.

    `keys[i]`, `values[i]`: `[B, num_key_value_heads, N, head_dim]` (k after `k_norm` and RoPE); `mask` `[B, N]`
    bool (False = padding); `positions` `[B, N]`. Block K/V are never stored, so after a verification nothing has
    to be removed: the caller appends the committed positions with `extend_context`.
    """

    def __init__(self, num_layers: int, batch_size: int):
        if batch_size <= 0:
            raise ValueError(f"DSparkCache: batch_size must be > 0, got {batch_size}")
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.reset()

    def reset(self) -> None:
        self.keys: list[torch.Tensor | None] = [None] * self.num_layers
        self.values: list[torch.Tensor | None] = [None] * self.num_layers
        self.mask: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Context rows held per sequence (padding rows included)."""
        return 0 if self.mask is None else self.mask.shape[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.num_tokens

    def next_positions(self) -> torch.Tensor | None:
        """`[B]`: the position after each row's last real context token (its count of real tokens)."""
        return None if self.mask is None else self.mask.sum(dim=1)

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor,
               positions: torch.Tensor) -> None:  # fmt: skip
        if self.mask is None:
            self.keys, self.values = list(keys), list(values)
            self.mask, self.positions = mask, positions
            return
        self.keys = [torch.cat([old, new], dim=2) for old, new in zip(self.keys, keys, strict=True)]
        self.values = [torch.cat([old, new], dim=2) for old, new in zip(self.values, values, strict=True)]
        self.mask = torch.cat([self.mask, mask], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def crop(self, max_length: int) -> None:
        """`KDSACache.crop`'s convention: `max_length > 0` keeps that many rows, `max_length <= 0` removes
        `-max_length` rows (0 removes none)."""
        new_length = self.num_tokens + max_length if max_length <= 0 else max_length
        if not 0 <= new_length <= self.num_tokens:
            raise ValueError(f"cannot crop a DSparkCache holding {self.num_tokens} rows to {new_length} rows")
        if new_length == 0:
            self.reset()
            return
        self.keys = [k[:, :, :new_length] for k in self.keys]
        self.values = [v[:, :, :new_length] for v in self.values]
        self.mask = self.mask[:, :new_length]
        self.positions = self.positions[:, :new_length]

    def select(self, indices: torch.Tensor) -> None:
        """Keeps (or reorders) batch rows: `indices` `[B']`."""
        self.batch_size = int(indices.numel())
        if self.mask is None:
            return
        self.keys = [k[indices] for k in self.keys]
        self.values = [v[indices] for v in self.values]
        self.mask, self.positions = self.mask[indices], self.positions[indices]


# ------------------------------------------------------------------------------------------------ layers


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Plain RoPE (Qwen3, NeoX half-split): `[..., head_dim]` cos and sin in `cat(freqs, freqs)` layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=position_ids.device) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class DSparkAttention(nn.Module):
    """Qwen3 attention whose keys and values are `[context rows ; block rows]` (paper eq. 3)."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = KDSARMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = KDSARMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`hidden` `[B, T, H]`, cos/sin `[B, T, head_dim]` → k, v `[B, kv_heads, T, head_dim]`."""
        batch, length, _ = hidden.shape
        k = self.k_norm(self.k_proj(hidden).view(batch, length, self.num_kv_heads, self.head_dim))
        k = apply_rotary_half(k, cos[:, :, None], sin[:, :, None])
        v = self.v_proj(hidden).view(batch, length, self.num_kv_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, hidden, cos, sin, context_k, context_v, attention_mask):
        """`hidden` `[B, Q, H]` (block rows, normed), `context_k/v` `[B, kv_heads, N, head_dim]`, `attention_mask`
        `[B, Q, N + Q]` bool (True = attend)."""
        batch, length, _ = hidden.shape
        q = self.q_norm(self.q_proj(hidden).view(batch, length, self.num_heads, self.head_dim))
        q = apply_rotary_half(q, cos[:, :, None], sin[:, :, None]).transpose(1, 2)
        k_block, v_block = self.project_kv(hidden, cos, sin)
        k = torch.cat([context_k.to(k_block.dtype), k_block], dim=2)
        v = torch.cat([context_v.to(v_block.dtype), v_block], dim=2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask[:, None], scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DSparkMLP(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config: DSparkConfig):
        super().__init__()
        self.self_attn = DSparkAttention(config)
        self.mlp = DSparkMLP(config)
        self.input_layernorm = KDSARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KDSARMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, cos, sin, context_k, context_v, attention_mask):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, context_k, context_v, attention_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DSparkMarkovHead(nn.Module):
    """Logit bias from the previous token (paper eq. 4–6). `markov_w1` `[V_target, r]` (indexed by target ids),
    `markov_w2` `[V_draft, r]`. vanilla: `W2·W1[x]`; gated: `W2·(σ(gate_proj([h ; W1[x]])) ⊙ W1[x])`; rnn:
    `z = [s ; W1[x] ; h]`, `g, c, o = joint_proj(z)`, `s' = σ(g)·s + (1−σ(g))·tanh(c)`, bias `W2·tanh(o)`, s_0 = 0."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        rank, hidden = config.markov_rank, config.hidden_size
        self.head_type = config.markov_head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(config.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, config.draft_vocab_size, bias=False)
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def initial_state(self, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(*like.shape[:-1], self.rank) if self.head_type == "rnn" else None

    def step(self, prev_ids: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """One slot: `prev_ids` `[...]`, `hidden` `[..., H]` → (bias `[..., V_draft]`, new state, W1[prev])."""
        prev = self.markov_w1(prev_ids).to(hidden.dtype)
        if self.head_type == "vanilla":
            return self.markov_w2(prev), state, prev
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev], dim=-1)))
            return self.markov_w2(gate * prev), state, prev
        gate, candidate, output = self.joint_proj(torch.cat([state, prev, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state, prev


class DSparkConfidenceHead(nn.Module):
    """`c_k = w·[h_k ; W1[x_{k−1}]] + b` (a logit; σ gives the survival probability), paper eq. 7."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        extra = config.markov_rank if config.confidence_head_with_markov else 0
        self.proj = nn.Linear(config.hidden_size + extra, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


@dataclass
class DSparkBlockOutput:
    """Teacher-forced block outputs of `DSparkDraftModel.forward`: `hidden` `[B, A, γ, H]`, `logits` `[B, A, γ,
    V_target]` (Markov-corrected; −inf outside a reduced vocabulary), `confidence_logits` `[B, A, γ]` or None."""

    hidden: torch.Tensor
    logits: torch.Tensor
    confidence_logits: torch.Tensor | None


SampleFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def greedy_sample(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.argmax(dim=-1), logits


# ------------------------------------------------------------------------------------------------- model


class DSparkDraftModel(PreTrainedModel):
    """A DSpark drafter for a KDSA (or any transformers) target. See the module docstring for the math.

    Inference API: `bind_target(target)`, `new_cache(batch_size)`, `extend_context(cache, hidden_states, ...)`,
    `propose(cache, anchor_ids, anchor_position_ids, sample)`. Training API: `forward` (teacher-forced blocks at
    given anchors over a whole sequence).
    """

    config_class = DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "input_ids"
    _supports_sdpa = True

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.layers = nn.ModuleList(DSparkDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = KDSARMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, hidden, bias=False)
        self.hidden_norm = KDSARMSNorm(hidden, eps=config.rms_norm_eps)
        if config.owns_embeddings:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
            self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        elif config.reduced_vocabulary:
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.markov_head = DSparkMarkovHead(config) if config.markov_rank else None
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None
        # The target's modules when shared (`bind_target`); plain attributes, so they are not the draft's parameters.
        object.__setattr__(self, "_shared_embed", None)
        object.__setattr__(self, "_shared_lm_head", None)
        object.__setattr__(self, "_num_bound_target_layers", None)
        self.post_init()

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, KDSARMSNorm):
            nn.init.ones_(module.weight)

    # ---------------------------------------------------------------------------------------- target binding

    def bind_target(self, target: nn.Module) -> DSparkDraftModel:
        """Checks the target against the draft (hidden size, vocabulary, layer ids) and shares the target's
        `embed_tokens` / `lm_head` where the checkpoint has none (the target's modules, not copies: frozen or not
        is the target's business). Returns the draft."""
        config = self.config
        text_config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        num_layers = int(text_config.num_hidden_layers)
        if config.num_target_layers is not None and config.num_target_layers != num_layers:
            raise ValueError(
                f"DSpark draft was trained for a target with num_target_layers={config.num_target_layers} layers; "
                f"this target has {num_layers}"
            )
        for layer_id in config.target_layer_ids:
            check_target_layer_id(layer_id, num_layers)
        if text_config.hidden_size != config.target_hidden_size:
            raise ValueError(
                f"DSpark draft expects target_hidden_size={config.target_hidden_size}; the target's hidden_size is "
                f"{text_config.hidden_size}"
            )
        if text_config.vocab_size != config.vocab_size:
            raise ValueError(
                f"DSpark draft expects a target vocab_size of {config.vocab_size}; the target has "
                f"{text_config.vocab_size}"
            )
        if not config.owns_embeddings:
            # The module's sizes, not its weight's: under tensor parallelism the target holds some vocabulary rows only
            # (docs/parallel.md §5), and its embedding and head still take and return the whole vocabulary.
            embed = target.get_input_embeddings()
            if (embed.num_embeddings, embed.embedding_dim) != (config.vocab_size, config.hidden_size):
                shape = (embed.num_embeddings, embed.embedding_dim)
                raise ValueError(
                    f"DSpark draft shares the target's embed_tokens, which is {shape}; the draft "
                    f"needs ({config.vocab_size}, {config.hidden_size})"
                )
            object.__setattr__(self, "_shared_embed", embed)
            if not config.reduced_vocabulary:
                head = target.get_output_embeddings()
                if head is None or (head.out_features, head.in_features) != (config.vocab_size, config.hidden_size):
                    shape = None if head is None else (head.out_features, head.in_features)
                    raise ValueError(f"DSpark draft shares the target's lm_head, which is {shape}; the draft needs "
                                     f"({config.vocab_size}, {config.hidden_size})")  # fmt: skip
                object.__setattr__(self, "_shared_lm_head", head)
        object.__setattr__(self, "_num_bound_target_layers", num_layers)
        return self

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        embed = self.embed_tokens if self.config.owns_embeddings else self._shared_embed
        if embed is None:
            raise ValueError("this DSpark draft has no embed_tokens of its own: call draft.bind_target(target) first")
        return embed(ids).to(self.fc.weight.dtype)

    def _head(self) -> nn.Module:
        if self.config.owns_embeddings or self.config.reduced_vocabulary:
            return self.lm_head
        if self._shared_lm_head is None:
            raise ValueError("this DSpark draft has no lm_head of its own: call draft.bind_target(target) first")
        return self._shared_lm_head

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`lm_head(h)`: `[..., V_draft]`, fp32."""
        head = self._head()
        return head(hidden.to(head.weight.dtype)).float()

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """`[..., V_draft]` → `[..., V_target]`: identity for the full vocabulary; otherwise each draft id goes to
        `draft id + d2t[draft id]` and every other target id gets −inf."""
        if not self.config.reduced_vocabulary:
            return logits
        target_ids = torch.arange(self.config.draft_vocab_size, device=logits.device) + self.d2t
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, target_ids, logits)

    def check_vocabulary_mapping(self) -> None:
        """`d2t` / `t2d` must describe the same `draft_vocab_size` target ids, each once."""
        if not self.config.reduced_vocabulary:
            return
        target_ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        if bool(((target_ids < 0) | (target_ids >= self.config.vocab_size)).any()):
            raise ValueError(
                f"DSpark tensor d2t maps draft ids outside the target vocabulary (0..{self.config.vocab_size - 1})"
            )
        if int(self.t2d.sum()) != self.config.draft_vocab_size:
            raise ValueError(
                f"DSpark tensor t2d marks {int(self.t2d.sum())} target ids; draft_vocab_size is "
                f"{self.config.draft_vocab_size}"
            )
        if not torch.equal(torch.sort(target_ids).values, self.t2d.nonzero().flatten()):
            raise ValueError("DSpark tensors d2t and t2d disagree: d2t's target ids are not the ids t2d marks")

    # ------------------------------------------------------------------------------------------- backbone

    def context_features(self, target_hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """The target's `hidden_states` tuple (index i = input of layer i, index L = final normed) → the
        concatenated context features `[B, T, m·H_target]` at `hidden_states[id + 1]` for each target layer id."""
        if isinstance(target_hidden_states, torch.Tensor) or not isinstance(target_hidden_states, Sequence):
            raise ValueError(
                "target_hidden_states must be the target's hidden_states tuple (output_hidden_states=True)"
            )
        count = len(target_hidden_states)
        bound = self._num_bound_target_layers
        if bound is not None and count != bound + 1:
            raise ValueError(
                f"target_hidden_states has {count} entries; the bound target gives {bound + 1} (embeddings, then one "
                "per layer with the final normed state last)"
            )
        indices = self.config.hidden_state_indices
        if max(indices) >= count - 1:
            raise ValueError(f"target_hidden_states has {count} entries: hidden_states index {max(indices)} (a target "
                             "layer id + 1) is not a layer output")  # fmt: skip
        return torch.cat([target_hidden_states[i] for i in indices], dim=-1)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """`hidden_norm(fc(features))`: `[B, T, m·H_target]` → `[B, T, H]`."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def _context_kv(self, context: torch.Tensor, positions: torch.Tensor):
        cos, sin = self._rope(positions, context.dtype)
        kv = [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]
        return [k for k, _ in kv], [v for _, v in kv]

    def _backbone(self, block_embeds, block_positions, context_keys, context_values, attention_mask):
        """Block rows `[B, Q, H]` at `block_positions` `[B, Q]` through every layer; returns `norm(h)`."""
        cos, sin = self._rope(block_positions, block_embeds.dtype)
        hidden = block_embeds
        for layer, k, v in zip(self.layers, context_keys, context_values, strict=True):
            hidden = layer(hidden, cos, sin, k, v, attention_mask)
        return self.norm(hidden)

    def _block_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """`[...]` anchors → `[..., γ]` `[anchor, MASK × (γ−1)]`."""
        mask = torch.full((*anchor_ids.shape, self.config.block_size - 1), self.config.mask_token_id,
                          dtype=anchor_ids.dtype, device=anchor_ids.device)  # fmt: skip
        return torch.cat([anchor_ids[..., None], mask], dim=-1)

    def _confidence(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        features = torch.cat([hidden, prev_embedding], dim=-1) if self.config.confidence_head_with_markov else hidden
        return self.confidence_head(features).float()

    # ------------------------------------------------------------------------------------------- inference

    def new_cache(self, batch_size: int) -> DSparkCache:
        return DSparkCache(self.config.num_hidden_layers, batch_size)

    @torch.no_grad()
    def extend_context(
        self,
        cache: DSparkCache,
        target_hidden_states: Sequence[torch.Tensor],
        attention_mask_new: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> None:
        """Appends T committed positions to the context: `target_hidden_states` is the target's `hidden_states`
        tuple for exactly those positions (each `[B, T, H_target]`); `attention_mask_new` `[B, T]` (1 = real token,
        default all ones); `position_ids` `[B, T]` (default: each row continues its count of real tokens)."""
        features = self.context_features(target_hidden_states)
        batch, length, _ = features.shape
        if batch != cache.batch_size:
            raise ValueError(f"target_hidden_states has batch {batch}; the DSparkCache was made for {cache.batch_size}")
        if attention_mask_new is None:
            attention_mask_new = torch.ones(batch, length, dtype=torch.bool, device=features.device)
        if tuple(attention_mask_new.shape) != (batch, length):
            raise ValueError(f"attention_mask_new is {tuple(attention_mask_new.shape)}; expected ({batch}, {length})")
        mask = attention_mask_new.to(device=features.device, dtype=torch.bool)
        if position_ids is None:
            start = cache.next_positions()
            start = torch.zeros(batch, dtype=torch.long, device=features.device) if start is None else start
            position_ids = (start[:, None] + mask.long().cumsum(dim=1) - 1).clamp(min=0)
        if tuple(position_ids.shape) != (batch, length):
            raise ValueError(f"position_ids is {tuple(position_ids.shape)}; expected ({batch}, {length})")
        keys, values = self._context_kv(self.project_context(features), position_ids)
        cache.append(keys, values, mask, position_ids.to(torch.long))

    @torch.no_grad()
    def propose(
        self,
        cache: DSparkCache,
        anchor_ids: torch.Tensor,
        anchor_position_ids: torch.Tensor,
        sample: SampleFn | None = None,
        confidence_threshold: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One block: `anchor_ids` `[B]` (the last committed token, not yet in the context) at
        `anchor_position_ids` `[B]`. One backbone forward over `[anchor, MASK × (γ−1)]`, then the Markov loop:
        `logits_k = U_k + bias(x_{k−1})` (x_{−1} = anchor), `tok, processed = sample(logits_k [B, V_target], k)`
        (default greedy). Returns `tokens` `[B, n]`, `q_logits` `[B, n, V_target]` (the processed logits),
        `confidence` `[B, n]` (σ of the confidence head; None without one), n ≤ γ. The cache is not changed.

        `confidence_threshold` > 0 prunes the block (DeepSpec's static rule): slot k's confidence depends only on
        h_k and x_{k−1}, so it is known before slot k is sampled, and the loop stops at the first slot where no row
        is still confident (every row's run of confidences ≥ the threshold has ended) — a pruned slot costs no
        sampling. n = 0 when slot 0 is not confident anywhere."""
        sample = greedy_sample if sample is None else sample
        if cache.mask is None:
            raise ValueError("propose needs a context: call extend_context with the prompt's hidden states first")
        batch = cache.batch_size
        if anchor_ids.shape != (batch,) or anchor_position_ids.shape != (batch,):
            raise ValueError(f"anchor_ids and anchor_position_ids must be [{batch}]; got "
                             f"{tuple(anchor_ids.shape)} and {tuple(anchor_position_ids.shape)}")  # fmt: skip
        gamma = self.config.block_size
        block_ids = self._block_ids(anchor_ids)
        positions = anchor_position_ids[:, None].long() + torch.arange(gamma, device=anchor_ids.device)
        mask = torch.cat([cache.mask[:, None, :].expand(-1, gamma, -1),
                          cache.mask.new_ones(batch, gamma, gamma)], dim=2)  # fmt: skip
        hidden = self._backbone(self._embed(block_ids), positions, cache.keys, cache.values, mask)
        base = self.draft_logits(hidden)  # [B, γ, V_draft]
        tokens, q_logits, confidence = [], [], []
        prev = anchor_ids
        confident = torch.ones(batch, dtype=torch.bool, device=anchor_ids.device)
        state = None if self.markov_head is None else self.markov_head.initial_state(hidden[:, 0])
        for k in range(gamma):
            logits, prev_embedding = base[:, k], None
            if self.markov_head is not None:
                bias, state, prev_embedding = self.markov_head.step(prev, hidden[:, k], state)
                logits = logits + bias.float()
            conf = self._confidence(hidden[:, k], prev_embedding)
            if conf is not None:
                conf = torch.sigmoid(conf)
                if confidence_threshold > 0:
                    confident &= conf >= confidence_threshold
                    if not bool(confident.any()):
                        break
                confidence.append(conf)
            token, processed = sample(self.to_target_vocab(logits), k)
            tokens.append(token)
            q_logits.append(processed)
            prev = token
        if not tokens:
            vocab = self.config.vocab_size
            return anchor_ids.new_zeros(batch, 0), base.new_zeros(batch, 0, vocab, dtype=torch.float32), None
        confidence = torch.stack(confidence, dim=1) if confidence else None
        return torch.stack(tokens, dim=1), torch.stack(q_logits, dim=1), confidence

    # -------------------------------------------------------------------------------------------- training

    def forward(
        self,
        input_ids: torch.Tensor,
        context_features: torch.Tensor,
        anchor_positions: torch.Tensor,
        context_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> DSparkBlockOutput:
        """Teacher-forced blocks for training. `input_ids` `[B, S]` (the committed sequence), `context_features`
        `[B, S, m·H_target]` (`context_features(hidden_states)` of the target over the same sequence),
        `anchor_positions` `[B, A]` (each < S). The block at anchor p sees the context rows j < p (non-padding per
        `context_mask` `[B, S]`) and its own γ slots; slot k predicts the token at p + k + 1, and its Markov bias uses
        the true previous token `input_ids[p + k]` (positions past the end are clamped: mask them in the loss)."""
        batch, seq_len = input_ids.shape
        anchors = anchor_positions.long()
        num_anchors, gamma = anchors.shape[1], self.config.block_size
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device).expand(batch, -1)
        if context_mask is None:
            context_mask = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
        context = self.project_context(context_features)
        keys, values = self._context_kv(context, position_ids)
        anchor_ids = input_ids.gather(1, anchors)
        block_ids = self._block_ids(anchor_ids).reshape(batch, num_anchors * gamma)
        offsets = torch.arange(gamma, device=device)
        block_positions = (position_ids.gather(1, anchors)[:, :, None] + offsets).reshape(batch, -1)
        sees_context = torch.arange(seq_len, device=device)[None, None, :] < anchors[:, :, None]  # [B, A, S]
        sees_context = (sees_context & context_mask[:, None, :].bool()).repeat_interleave(gamma, dim=1)
        same_block = torch.eye(num_anchors, dtype=torch.bool, device=device).repeat_interleave(gamma, dim=0)
        same_block = same_block.repeat_interleave(gamma, dim=1)[None].expand(batch, -1, -1)
        mask = torch.cat([sees_context, same_block], dim=2)
        hidden = self._backbone(self._embed(block_ids), block_positions, keys, values, mask)
        hidden = hidden.view(batch, num_anchors, gamma, -1)
        logits = self.draft_logits(hidden)
        prev_index = (anchors[:, :, None] + offsets).clamp(max=seq_len - 1)
        prev_ids = input_ids.gather(1, prev_index.view(batch, -1)).view(batch, num_anchors, gamma)
        prev_embeddings = None
        if self.markov_head is not None:
            if self.markov_head.head_type == "rnn":
                state, biases, prevs = self.markov_head.initial_state(hidden[:, :, 0]), [], []
                for k in range(gamma):
                    bias, state, prev = self.markov_head.step(prev_ids[..., k], hidden[:, :, k], state)
                    biases.append(bias)
                    prevs.append(prev)
                bias, prev_embeddings = torch.stack(biases, dim=2), torch.stack(prevs, dim=2)
            else:
                bias, _, prev_embeddings = self.markov_head.step(prev_ids, hidden, None)
            logits = logits + bias.float()
        confidence = self._confidence(hidden, prev_embeddings)
        return DSparkBlockOutput(hidden=hidden, logits=self.to_target_vocab(logits), confidence_logits=confidence)

    # ------------------------------------------------------------------------------------------ checkpoints

    @classmethod
    def config_from_checkpoint(cls, raw: dict) -> tuple[DSparkConfig, str]:
        """A speculators or DeepSpec `config.json` dict → (DSparkConfig, format name). Anything else is refused."""
        model_type = raw.get("speculators_model_type")
        if model_type is not None:
            return _config_from_speculators(raw), SPECULATORS_FORMAT
        architectures = raw.get("architectures") or []
        if DEEPSPEC_ARCHITECTURE in architectures:
            return _config_from_deepspec(raw), DEEPSPEC_FORMAT
        raise ValueError(
            "not a DSpark checkpoint: config.json has no speculators_model_type and its architectures "
            f"{architectures} do not include {DEEPSPEC_ARCHITECTURE!r} (DeepSpec form)"
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *, target: nn.Module | None = None,
                        dtype: torch.dtype | None = None, **kwargs) -> DSparkDraftModel:  # fmt: skip
        """Loads a speculators (`speculators_model_type: "dspark"`) or DeepSpec (`Qwen3DSparkModel`) folder, strictly:
        every tensor of the file is used and every parameter is filled, shapes checked; anything else is a
        `ValueError` naming it. `target`: bind it at once (`bind_target`). `dtype`: cast after loading (default: the
        file's). Other keyword arguments go to `transformers.utils.cached_file` (hub ids)."""
        from safetensors.torch import load_file
        from transformers.utils import cached_file

        dtype = kwargs.pop("torch_dtype", dtype)
        kwargs.pop("trust_remote_code", None)

        def resolve(name: str, required: bool = True):
            return cached_file(pretrained_model_name_or_path, name, _raise_exceptions_for_missing_entries=required,
                               **kwargs)  # fmt: skip

        with open(resolve("config.json")) as f:
            raw = json.load(f)
        config, _ = cls.config_from_checkpoint(raw)
        index_path = resolve("model.safetensors.index.json", required=False)
        if index_path is not None:
            with open(index_path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            tensors = {}
            for shard in shards:
                tensors.update(load_file(resolve(shard)))
        else:
            tensors = load_file(resolve("model.safetensors"))
        with torch.device("meta"):
            model = cls(config)
        model.load_checkpoint_tensors(tensors)
        if dtype is not None:
            model.to(dtype)
        if target is not None:
            model.bind_target(target)
        return model.eval()

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Strict load: the file's tensor names must be exactly this model's state-dict names, with equal shapes."""
        expected = self.state_dict()
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        if missing:
            raise ValueError(
                f"DSpark checkpoint is missing tensor(s) {missing[:8]}" + (" ..." if len(missing) > 8 else "")
            )
        if unexpected:
            hint = ""
            if any(name.startswith(("embed_tokens", "lm_head")) for name in unexpected):
                hint = " (a full-vocabulary speculators checkpoint carries no embed_tokens / lm_head)"
            raise ValueError(f"DSpark checkpoint has unexpected tensor(s) {unexpected[:8]}{hint}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(
                    f"DSpark tensor {name} has shape {tuple(tensor.shape)}; the config gives "
                    f"{tuple(expected[name].shape)}"
                )
            if expected[name].dtype in (torch.long, torch.bool) and tensor.dtype != expected[name].dtype:
                raise ValueError(f"DSpark tensor {name} has dtype {tensor.dtype}; expected {expected[name].dtype}")
        self.load_state_dict(tensors, strict=True, assign=True)
        self.check_vocabulary_mapping()

    def speculators_config(self, verifier_name_or_path: str | None = None) -> dict:
        """config.json of the speculators DSpark format for this draft."""
        config = self.config
        layer_config = {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": config.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "attention_bias": config.attention_bias,
            "max_position_embeddings": config.max_position_embeddings,
            "layer_types": ["full_attention"] * config.num_hidden_layers,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        }
        return {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "dspark",
            "speculators_version": SPECULATORS_FORMAT_VERSION,
            "speculators_config": {
                "algorithm": "dspark",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier_name_or_path, "architectures": []},
            },
            "transformer_layer_config": layer_config,
            "draft_vocab_size": config.draft_vocab_size,
            "block_size": config.block_size,
            "target_hidden_size": config.target_hidden_size,
            "aux_hidden_state_layer_ids": config.hidden_state_indices,
            "mask_token_id": config.mask_token_id,
            "sliding_window_non_causal": False,
            "sample_from_anchor": True,
            "markov_rank": config.markov_rank,
            "markov_head_type": config.markov_head_type,
            "enable_confidence_head": config.enable_confidence_head,
            "confidence_head_with_markov": config.confidence_head_with_markov,
            "num_target_layers": config.num_target_layers,
        }

    def save_pretrained(self, save_directory, verifier_name_or_path: str | None = None, **kwargs) -> None:
        """Writes the speculators DSpark format: config.json and model.safetensors (no embed_tokens; no lm_head with
        the full vocabulary — a loader takes both from the verifier)."""
        from safetensors.torch import save_file

        os.makedirs(save_directory, exist_ok=True)
        state = self.state_dict()
        drop = ("embed_tokens.",) + (() if self.config.reduced_vocabulary else ("lm_head.",))
        tensors = {name: t.detach().contiguous().cpu() for name, t in state.items() if not name.startswith(drop)}
        save_file(tensors, os.path.join(save_directory, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(save_directory, "config.json"), "w") as f:
            json.dump(self.speculators_config(verifier_name_or_path), f, indent=2)
            f.write("\n")


def _qwen3_fields(layer_config: dict, where: str) -> dict:
    """Backbone fields of a Qwen3 config dict, defaults resolved as transformers' Qwen3Config does (speculators
    writes `to_diff_dict()`, which leaves the defaults out)."""
    model_type = layer_config.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise ValueError(f"DSpark {where}: model_type {model_type!r} is not supported (the backbone is Qwen3)")
    known = {key: value for key, value in layer_config.items() if key not in ("architectures", "auto_map")}
    qwen = Qwen3Config(**known)
    rope = dict(getattr(qwen, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"DSpark {where}: rope type {rope.get('rope_type')!r} is not supported (plain RoPE only)")
    layer_types = list(qwen.layer_types or [])
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"DSpark {where}: layer_types {layer_types} has non-full-attention layers (sliding windows "
                         "are not supported)")  # fmt: skip
    if getattr(qwen, "hidden_act", "silu") != "silu":
        raise ValueError(f"DSpark {where}: hidden_act {qwen.hidden_act!r} is not supported (SwiGLU with silu)")
    return {
        "vocab_size": qwen.vocab_size,
        "hidden_size": qwen.hidden_size,
        "intermediate_size": qwen.intermediate_size,
        "num_hidden_layers": qwen.num_hidden_layers,
        "num_attention_heads": qwen.num_attention_heads,
        "num_key_value_heads": qwen.num_key_value_heads,
        "head_dim": qwen.head_dim,
        "rms_norm_eps": qwen.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "attention_bias": qwen.attention_bias,
        "max_position_embeddings": qwen.max_position_embeddings,
    }


def _required(raw: dict, key: str, where: str):
    if raw.get(key) is None:
        raise ValueError(f"DSpark {where} config.json lacks {key}")
    return raw[key]


def _head_fields(raw: dict) -> dict:
    return {
        "markov_rank": int(raw.get("markov_rank", 0) or 0),
        "markov_head_type": str(raw.get("markov_head_type") or "vanilla").lower(),
        "enable_confidence_head": bool(raw.get("enable_confidence_head", False)),
        "confidence_head_with_markov": bool(raw.get("confidence_head_with_markov", False)),
    }


def _config_from_speculators(raw: dict) -> DSparkConfig:
    model_type = raw["speculators_model_type"]
    if model_type == "dflash":
        raise ValueError(
            "speculators_model_type 'dflash' is refused: a DFlash layout (1 + N blocks, the anchor slot makes no "
            "prediction) is not a DSpark draft; DSparkDraftModel runs the anchor-first layout only"
        )
    if model_type != "dspark":
        raise ValueError(f"speculators_model_type {model_type!r} is not supported (only 'dspark')")
    where = "speculators"
    if raw.get("sample_from_anchor", True) is not True:
        raise ValueError(
            f"speculators sample_from_anchor={raw.get('sample_from_anchor')!r} is refused: that is the DFlash 1 + N "
            "layout; a DSpark draft is anchor-first (sample_from_anchor: true)"
        )
    layer_config = _required(raw, "transformer_layer_config", where)
    fields = _qwen3_fields(layer_config, "transformer_layer_config")
    aux = _required(raw, "aux_hidden_state_layer_ids", where)
    if not isinstance(aux, list) or not all(isinstance(i, int) for i in aux):
        raise ValueError(f"speculators aux_hidden_state_layer_ids must be a list of integers, got {aux!r}")
    for index in aux:
        if index < 1:
            raise ValueError(
                f"speculators aux_hidden_state_layer_ids entry {index} is out of range: these are hidden_states "
                "indices (target layer id + 1), so each is >= 1"
            )
    draft_vocab = int(raw.get("draft_vocab_size") or fields["vocab_size"])
    return DSparkConfig(
        **fields,
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(raw.get("target_hidden_size") or fields["hidden_size"]),
        target_layer_ids=[i - 1 for i in aux],
        num_target_layers=raw.get("num_target_layers"),
        block_size=int(_required(raw, "block_size", where)),
        mask_token_id=_required(raw, "mask_token_id", where),
        owns_embeddings=False,
        **_head_fields(raw),
    )


def _config_from_deepspec(raw: dict) -> DSparkConfig:
    where = "DeepSpec"
    fields = _qwen3_fields(raw, "DeepSpec config")
    layer_ids = _required(raw, "target_layer_ids", where)
    if not isinstance(layer_ids, list) or not all(isinstance(i, int) for i in layer_ids):
        raise ValueError(f"DeepSpec target_layer_ids must be a list of integers, got {layer_ids!r}")
    num_target_layers = raw.get("num_target_layers")
    return DSparkConfig(
        **fields,
        draft_vocab_size=fields["vocab_size"],
        target_hidden_size=fields["hidden_size"],
        target_layer_ids=layer_ids,
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        block_size=int(_required(raw, "block_size", where)),
        mask_token_id=_required(raw, "mask_token_id", where),
        owns_embeddings=True,
        **_head_fields(raw),
    )


def total_variation(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """`½ Σ_v |softmax(p) − softmax(q)|` over the last dim."""
    return 0.5 * (p_logits.float().softmax(-1) - q_logits.float().softmax(-1)).abs().sum(-1)


def expected_accepted_length(tv: torch.Tensor) -> torch.Tensor:
    """Analytic τ per block from per-slot TVs `[..., γ]`: `1 + Σ_k Π_{j≤k} (1 − TV_j)` (speculators' accept_len)."""
    return 1 + torch.cumprod(1 - tv, dim=-1).sum(-1)


__all__ = [
    "DSparkBlockOutput",
    "DSparkCache",
    "DSparkConfig",
    "DSparkDraftModel",
    "expected_accepted_length",
    "greedy_sample",
    "total_variation",
]
