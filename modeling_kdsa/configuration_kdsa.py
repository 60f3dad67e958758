"""KDSA configuration: a hybrid of KDA (Kimi Delta Attention) and DSA (DeepSeek Sparse Attention) layers.

Field names follow transformers' `KimiLinearConfig` (KDA, MoE) and `DeepseekV32Config` (MLA, indexer, MoE) wherever
the concept is the same, so that converters for those checkpoints are a renaming, not a rewrite (DESIGN.md §2, §11).
"""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

from .numeric_formats import CacheFormats

# The built-in transformers layer-type names, so that `DynamicCache(config)` and masks work unchanged.
KDA_LAYER = "linear_attention"
DSA_LAYER = "indexed_attention"
# Dense MLA (every cached token, no indexer): Kimi-Linear's and Kimi K3's attention layers.
MLA_LAYER = "full_attention"
SUPPORTED_LAYER_TYPES = (KDA_LAYER, DSA_LAYER, MLA_LAYER)
INDEXER_TYPES = ("full", "shared")
KERNEL_BACKENDS = ("auto", "torch", "cpu", "compiled")


@strict
class KDSAConfig(PreTrainedConfig):
    r"""
    Configuration of a KDSA model. Defaults describe a small but realistic model (hidden 1024, 8 layers at
    3 KDA : 1 DSA, 16 heads, MoE with 8 experts top-2).

    layer_types (`list[str]`): per layer, `"linear_attention"` (KDA), `"indexed_attention"` (DSA) or
        `"full_attention"` (dense MLA: attends to every cached token, no indexer). Default: every 4th layer is DSA,
        the rest KDA.
    linear_num_heads, linear_head_dim, linear_conv_kernel_dim: KDA heads, head dim (K = V) and short-conv width.
    q_lora_rank (`int | None`): MLA query LoRA rank; `None` uses a direct query projection.
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA dims; `qk_rope_head_dim=0` gives NoPE MLA.
    index_n_heads, index_head_dim, index_topk: Lightning Indexer heads, head dim and the number of selected keys.
    n_routed_experts, n_shared_experts, num_experts_per_tok, moe_intermediate_size, routed_scaling_factor,
    norm_topk_prob, first_k_dense_replace: MoE (DeepSeek-V3 style sigmoid router with correction bias).
    attn_res_block_size (`int`): sublayers (attention and FFN count one each) per Block-AttnRes block;
        0 = plain residual stream (Kimi-Linear / DeepSeek-style checkpoints).
    attn_res_final_aggregation (`bool`): with AttnRes, aggregate all blocks once more before the final norm.
    Family features (each defaults to "off", so KDSA's own checkpoints are unaffected; docs/real-checkpoints.md):
    mla_use_nope (`bool`): MLA keeps its `qk_rope_head_dim` slice unrotated (a shared, position-free key part), as
        Kimi-Linear and Kimi K3 do; the slice still exists and is cached.
    mla_norm_eps (`float | None`): eps of the MLA latent norms (`q_a_layernorm`, `kv_a_layernorm`); None =
        `rms_norm_eps`. Kimi-Linear uses 1e-6 there and 1e-5 elsewhere.
    n_group, topk_group (`int`): group-limited routing (DeepSeek-V3): experts form `n_group` groups, a group scores
        the sum of its two best biased scores, and each token routes within its `topk_group` best groups.
    swiglu_limit (`float | None`): clamp `gate <= limit`, `-limit <= up <= limit` before `act(gate) * up`, in the
        dense MLP, the shared and the routed experts (GLM-5.3-Flash); None = no clamp.
    linear_lower_bound (`float | None`): KDA "safe gate" `g = lower_bound · sigmoid(exp(A_log) · (f + dt_bias))`
        instead of `-exp(A_log) · softplus(f + dt_bias)` (GLM-5.3-Flash, Kimi K3); None = the softplus gate.
    index_kpool (`int`): the indexer scores pools of `index_kpool` consecutive tokens (learned per-channel softmax
        pooling of their keys) instead of single tokens, and selects `index_topk // index_kpool` pools
        (GLM-5.3-Flash); 1 = per-token keys.
    index_kpool_always_select_tail (`bool`): with pools, the query's incomplete last pool is always attended.
    indexer_types (`list[str] | None`): per layer, `"full"` (the DSA layer runs its indexer) or `"shared"` (it reuses
        the top-k of the previous DSA layer, which must be a `"full"` one); None = all `"full"`.
    hc_mult (`int`): > 0 replaces the residual stream by mHC hyper-connections with `hc_mult` streams (Sinkhorn-mixed,
        GLM-5.3-Flash); 0 = off. Exclusive with `attn_res_block_size > 0`.
    hc_sinkhorn_iters, hc_eps: mHC Sinkhorn iterations and its numerical floor.
    kernel_backend (`str`): which kernels read the paged DSA cache: `"torch"` (the readable reference),
        `"cpu"` (fused, memory-bounded), `"compiled"` (the fused kernels under torch.compile), or `"auto"`
        (`"cpu"` on CPU; the reference elsewhere until a device kernel has been verified on its hardware).
    """

    model_type = "kdsa"
    keys_to_ignore_at_inference = ["past_key_values"]
    # Heads and experts are sharded; KDA and DSA mixers have different attribute names (`linear_attn`,
    # `self_attn`) so that one plan entry can never hit the other mixer (reference/hf-integration.md §3.1).
    base_model_tp_plan = {
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }
    attribute_map = {"num_local_experts": "n_routed_experts"}

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    layer_types: list[str] | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 65536
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    # KDA
    linear_num_heads: int = 16
    linear_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    # MLA
    q_lora_rank: int | None = 384
    kv_lora_rank: int = 256
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    attention_bias: bool = False
    # Lightning Indexer
    index_n_heads: int = 8
    index_head_dim: int = 64
    index_topk: int = 512
    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 512
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    mlp_layer_types: list[str] | None = None
    # Residual stream
    attn_res_block_size: int = 4
    attn_res_final_aggregation: bool = True
    # Family features (off by default)
    mla_use_nope: bool = False
    mla_norm_eps: float | None = None
    n_group: int = 1
    topk_group: int = 1
    swiglu_limit: float | None = None
    linear_lower_bound: float | None = None
    index_kpool: int = 1
    index_kpool_always_select_tail: bool = True
    indexer_types: list[str] | None = None
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Kernels
    kernel_backend: str = "auto"

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = [DSA_LAYER if i % 4 == 3 else KDA_LAYER for i in range(self.num_hidden_layers)]
        if self.mlp_layer_types is None:
            n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
            self.mlp_layer_types = ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * self.num_hidden_layers
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        # transformers' rotary helpers read `head_dim`: RoPE covers only the decoupled rope slice.
        self.head_dim = self.qk_rope_head_dim
        self._check_consistency()
        super().__post_init__(**kwargs)
        # A checkpoint's `quantization_config` (set by the line above): transformers only warns and skips an
        # unregistered quant_method, which would load a silently wrong model, so fail here; for "kdsa", check that the
        # chosen blocks divide the cached widths (numeric_formats.CacheFormats.from_config raises naming the field).
        CacheFormats.from_config(self)

    def family_features_in_use(self) -> list[str]:
        """The family features (see the class doc) this config turns on, by field name: what code paths that do not
        support them yet (context parallelism) refuse by name."""
        in_use = {
            "layer_types (full_attention)": MLA_LAYER in self.layer_types,
            "mla_use_nope": self.mla_use_nope,
            "mla_norm_eps": self.mla_norm_eps is not None,
            "n_group": self.n_group != 1,
            "swiglu_limit": self.swiglu_limit is not None,
            "linear_lower_bound": self.linear_lower_bound is not None,
            "index_kpool": self.index_kpool != 1,
            "indexer_types (shared)": "shared" in self.indexer_types,
            "hc_mult": self.hc_mult != 0,
        }
        return [name for name, used in in_use.items() if used]

    def _check_consistency(self):
        """Raise a `ValueError` naming the offending field (DESIGN.md §10). Runs before transformers' validators,
        whose errors are not `ValueError`s."""
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in SUPPORTED_LAYER_TYPES:
                raise ValueError(
                    f"layer_types[{i}] = {layer_type!r} is not supported; use one of {SUPPORTED_LAYER_TYPES} "
                    f"('{KDA_LAYER}' = KDA, '{DSA_LAYER}' = DSA)"
                )
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        for i, mlp_type in enumerate(self.mlp_layer_types):
            if mlp_type not in ("dense", "sparse"):
                raise ValueError(f"mlp_layer_types[{i}] = {mlp_type!r} must be 'dense' or 'sparse'")
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
            "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
        ]  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.index_topk <= 0:
            raise ValueError(f"index_topk must be > 0, got {self.index_topk}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be None (direct query projection) or > 0, got {self.q_lora_rank}")
        if self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and >= 0 (0 = NoPE), got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim}): "
                "the indexer rotates its first qk_rope_head_dim channels"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.attn_res_block_size < 0:
            raise ValueError(f"attn_res_block_size must be >= 0 (0 = plain residual), got {self.attn_res_block_size}")
        if len(self.indexer_types) != self.num_hidden_layers:
            raise ValueError(
                f"indexer_types has {len(self.indexer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        previous_dsa_type = None
        for i, (layer_type, indexer_type) in enumerate(zip(self.layer_types, self.indexer_types, strict=True)):
            if indexer_type not in INDEXER_TYPES:
                raise ValueError(f"indexer_types[{i}] = {indexer_type!r} must be one of {INDEXER_TYPES}")
            if layer_type != DSA_LAYER:
                continue
            if indexer_type == "shared" and previous_dsa_type != "full":
                raise ValueError(
                    f"indexer_types[{i}] = 'shared' reuses the top-k of the previous DSA layer, which must be a 'full' "
                    f"one; the previous DSA layer is {previous_dsa_type!r}"
                )
            previous_dsa_type = indexer_type
        if self.n_group <= 0 or self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must be > 0 and divide n_routed_experts ({self.n_routed_experts})"
            )
        experts_per_group = self.n_routed_experts // self.n_group
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]")
        if self.n_group > 1 and experts_per_group < 2:
            raise ValueError(
                f"group-limited routing scores a group by its two best experts: n_routed_experts / n_group = "
                f"{experts_per_group} must be >= 2"
            )
        if self.num_experts_per_tok > self.topk_group * experts_per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of the topk_group "
                f"({self.topk_group}) selected groups ({self.topk_group * experts_per_group})"
            )
        if self.swiglu_limit is not None and self.swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit must be None (no clamp) or > 0, got {self.swiglu_limit}")
        if self.linear_lower_bound is not None and not self.linear_lower_bound < 0:
            raise ValueError(f"linear_lower_bound must be None or < 0, got {self.linear_lower_bound}")
        if self.mla_norm_eps is not None and self.mla_norm_eps <= 0:
            raise ValueError(f"mla_norm_eps must be None (= rms_norm_eps) or > 0, got {self.mla_norm_eps}")
        if self.index_kpool < 1:
            raise ValueError(f"index_kpool must be >= 1 (1 = per-token indexer keys), got {self.index_kpool}")
        if self.index_topk % self.index_kpool:
            raise ValueError(f"index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool})")
        if self.hc_mult < 0:
            raise ValueError(f"hc_mult must be >= 0 (0 = no hyper-connections), got {self.hc_mult}")
        if self.hc_mult > 0 and self.attn_res_block_size > 0:
            raise ValueError(
                f"hc_mult={self.hc_mult} (mHC hyper-connections) and attn_res_block_size={self.attn_res_block_size} "
                "(Block AttnRes) are two different residual streams: set one of them to 0"
            )
        if self.hc_sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {self.hc_sinkhorn_iters}")
        # Features whose config field exists but whose model code has not landed yet: refuse rather than ignore.
        pending = [
            "layer_types (full_attention)",
            "mla_use_nope",
            "mla_norm_eps",
            "n_group",
            "swiglu_limit",
            "linear_lower_bound",
            "index_kpool",
            "indexer_types (shared)",
            "hc_mult",
        ]
        for name in self.family_features_in_use():
            if name in pending:
                raise ValueError(f"{name} is not implemented yet")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")


__all__ = ["KDSAConfig"]
