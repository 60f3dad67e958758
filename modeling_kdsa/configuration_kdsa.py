"""KDSA configuration: a hybrid of KDA (Kimi Delta Attention) and DSA (DeepSeek Sparse Attention) layers.

Field names follow transformers' `KimiLinearConfig` (KDA, MoE) and `DeepseekV32Config` (MLA, indexer, MoE) wherever
the concept is the same, so that converters for those checkpoints are a renaming, not a rewrite (docs/design.md §2).
"""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

from .numeric_formats import CacheFormats

# The built-in transformers layer-type names, so that `DynamicCache(config)` and masks work unchanged.
KDA_LAYER = "linear_attention"
DSA_LAYER = "indexed_attention"
MLA_LAYER = "full_attention"  # dense MLA, no indexer (Kimi-Linear's attention layers)
SUPPORTED_LAYER_TYPES = (KDA_LAYER, DSA_LAYER, MLA_LAYER)
KERNEL_BACKENDS = ("auto", "torch", "cpu", "compiled", "npu", "triton")
ROUTED_EXPERT_WEIGHT_FORMATS = ("dense", "mxfp4")


@strict
class KDSAConfig(PreTrainedConfig):
    r"""
    Configuration of a KDSA model. Defaults describe a small but realistic model (hidden 1024, 8 layers at
    3 KDA : 1 DSA, 16 heads, MoE with 8 experts top-2).

    layer_types (`list[str]`): per layer, `"linear_attention"` (KDA), `"indexed_attention"` (DSA: MLA + Lightning
        Indexer + top-k sparse attention) or `"full_attention"` (dense causal MLA, no indexer: Kimi-Linear's
        attention layers, docs/dsa.md §8). Default: every 4th layer is DSA, the rest KDA.
    linear_num_heads, linear_head_dim, linear_conv_kernel_dim: KDA heads, head dim (K = V) and short-conv width.
    q_lora_rank (`int | None`): MLA query LoRA rank; `None` uses a direct query projection.
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA dims; `qk_rope_head_dim=0` gives NoPE MLA.
    mla_use_nope (`bool`): MLA keeps the `qk_rope_head_dim` slice of queries and keys but never rotates it
        (Kimi-Linear); the Lightning Indexer of DSA layers still rotates its own rope channels. Default False.
    mla_layernorm_eps (`float | None`): eps of `q_a_layernorm` and `kv_a_layernorm` in DSA and dense MLA layers;
        None uses rms_norm_eps (Kimi-Linear builds them with 1e-6 while its rms_norm_eps is 1e-5).
    index_n_heads, index_head_dim, index_topk: Lightning Indexer heads, head dim and the number of selected keys.
    n_routed_experts, n_shared_experts, num_experts_per_tok, moe_intermediate_size, routed_scaling_factor,
    norm_topk_prob, first_k_dense_replace: MoE (DeepSeek-V3 style sigmoid router with correction bias).
    n_group, topk_group (`int`): group-limited routing (DeepSeek-V3 / Kimi-Linear): the experts form `n_group`
        equal groups, each scored by the sum of its two best bias-corrected scores; only the experts of the best
        `topk_group` groups can be chosen. 1, 1 = plain top-k (docs/design.md §2).
    attn_res_block_size (`int`): sublayers (attention and FFN count one each) per Block-AttnRes block;
        0 = plain residual stream (Kimi-Linear / DeepSeek-style checkpoints).
    attn_res_final_aggregation (`bool`): with AttnRes, aggregate all blocks once more before the final norm.
    index_kpool (`int`): GLM-5.3-Flash k-pool indexer (docs/dsa.md §9): indexer keys pooled over groups of this many
        tokens with a learned per-channel softmax (`index_kpool_compress_gate`, `index_kpool_compress_ape`); top-k
        picks `index_topk // index_kpool` complete pools and attends to their tokens. 1 = one key per token. Must
        divide `index_topk` and the cache page size (64); NoPE only (`qk_rope_head_dim=0`).
    index_kpool_always_select_tail (`bool`): with `index_kpool > 1`, also attend to the query's own incomplete pool.
    indexer_types (`list[str] | None`): per layer `"full"` (own indexer) or `"shared"` (no indexer weights, no indexer
        cache; reuses the top-k of the layer right before it, which must be a `"full"` DSA layer, as transformers'
        Glm5Next passes it; docs/dsa.md §10). Entries of KDA layers are ignored. None = all `"full"`.
    linear_lower_bound (`float | None`): GLM-5.3-Flash's KDA forget gate. `None` = Kimi's
        `g = -exp(A_log)·softplus(f + dt_bias)`; a value `lb < 0` = `g = lb·sigmoid(exp(A_log)·(f + dt_bias))`, every
        log decay in `(lb, 0)` (docs/kda.md §2).
    swiglu_limit (`float | None`): GLM-5.3-Flash's SwiGLU clamp in the dense MLP, shared and routed experts: the gate
        is clamped to `<= swiglu_limit`, the up projection to `[-swiglu_limit, swiglu_limit]`. `None` = no clamp.
    hc_mult (`int`): mHC hyper-connections (docs/hyper-connections.md): the residual stream is `hc_mult` streams
        per token, mixed per sublayer and averaged before the final norm. 1 = no hyper-connections. Cannot be
        combined with Block AttnRes (`attn_res_block_size` must be 0).
    hc_eps (`float`): mHC epsilon added to the pre weights, the mixing matrix and the Sinkhorn denominators.
    hc_sinkhorn_iters (`int`): Sinkhorn-Knopp normalisations of the mHC mixing matrix (>= 1).
    mla_use_output_gate (`bool`): Kimi K3's gated MLA: the attention output (per head, before `o_proj`) is multiplied
        by `sigmoid(g_proj(x))`, `g_proj: D -> H·v_head_dim` (docs/kimi-k3.md §2). Default False.
    linear_use_full_rank_gate (`bool`): Kimi K3's KDA output gate: one full-rank `g_proj: D -> H·V` instead of the
        low-rank `g_a_proj`, `g_b_proj` pair (docs/kimi-k3.md §2). Default False.
    routed_expert_hidden_size (`int | None`): Kimi K3's LatentMoE: the routed experts run in this latent width, between
        one shared `routed_expert_down_proj` (D -> latent) and `routed_expert_up_proj` (latent -> D); router and shared
        experts stay in the full width (docs/kimi-k3.md §3). None = experts in the hidden width.
    latent_moe_use_norm (`bool`): with LatentMoE, RMSNorm (`routed_expert_norm`) the combined expert output in the
        latent width before the up projection.
    activation_situ_beta, activation_situ_linear_beta (`float`): the two soft caps of `hidden_act="situ"` (Kimi K3's
        gated activation `β·tanh(gate/β)·σ(gate) · β_lin·tanh(up/β_lin)` in fp32, docs/kimi-k3.md §3), used by the
        dense MLP, the shared and the routed experts. Ignored by other activations.
    routed_expert_weight_format (`str`): `"dense"` (weights in the model dtype) or `"mxfp4"` (OCP MX FP4: E2M1 codes
        two per byte, one E8M0 scale per 32 input columns, kept packed and dequantized per expert at use,
        docs/kimi-k3.md §4).
    kernel_backend (`str`): which kernels the model runs (the kernel registry, docs/backends.md §1: the paged DSA
        cache's readers, KDA, the layers' products): `"torch"` (the readable reference; no C++ kernel), `"cpu"`
        (fused, memory-bounded, with the C++ kernels of docs/backends.md §7 where they apply), `"compiled"` (the
        fused kernels under torch.compile), `"npu"` (torch_npu's fused Lightning Indexer and Sparse Flash
        Attention; contract-tested on CPU, not run on Ascend hardware, docs/backends.md §2), `"triton"` (Triton
        kernels reading the pages; tested under Triton's interpreter, not run on a GPU, docs/backends.md §4;
        opt-in), or `"auto"` (`"cpu"` on CPU, `"npu"` on an NPU, the reference
        elsewhere). These are the eager kernels; a compiled decode step with `KDSAStaticCache`
        (`generate(cache_implementation="static", compile_config=...)`) runs fixed-shape kernels whatever the backend
        (docs/graph-mode.md §2, §3).
    output_router_logits (`bool`): transformers' MoE training output: return each MoE layer's router logits
        (`router_logits`, one `[batch·seq, n_routed_experts]` fp32 tensor per sparse layer) and the load-balancing
        `aux_loss`, added to the LM loss times `router_aux_loss_coef` when labels are given (docs/design.md §9).
        Default False: no router output, today's loss.
    router_aux_loss_coef (`float`): weight of the load-balancing loss in the training loss (Glm5Next's 0.001).
    num_mtp_layers (`int`): multi-token-prediction layers after the trunk (DeepSeek-V3 §2.2; `num_nextn_predict_layers`
        in DeepSeek / GLM configs): each is `eh_proj([enorm(emb(t_{i+1})) ; hnorm(h_i)])`, one decoder block of the
        configuration `mtp_config()` describes, and a final norm before the model's own `lm_head` (modeling_kdsa.mtp).
        The forward pass of the model ignores them; speculative decoding drafts with them. 0 = none (default).
    """

    model_type = "kdsa"
    keys_to_ignore_at_inference = ["past_key_values"]
    # transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")`): one KDSA style per module kind, which
    # modeling_kdsa.parallel registers (parallel/hf_plans.py; docs/parallel.md §10); the embedding by vocabulary rows
    # (`lm_head` too: `KDSAForCausalLM._tp_plan`). No `base_model_pp_plan`: a decoder layer passes a residual-stream
    # object, not named tensors (docs/parallel.md §6).
    base_model_tp_plan = {
        "embed_tokens": "kdsa_vocab_embedding",
        "layers.*.linear_attn": "kdsa_kda_heads",
        "layers.*.self_attn": "kdsa_mla_heads",
        "layers.*.mlp": "kdsa_feed_forward",
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
    # MLA variants (Kimi-Linear): rope slice kept but not rotated; eps of the q / kv latent norms
    mla_use_nope: bool = False
    mla_layernorm_eps: float | None = None
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
    # Group-limited routing (DeepSeek-V3.2 / Kimi-Linear)
    n_group: int = 1
    topk_group: int = 1
    # Residual stream
    attn_res_block_size: int = 4
    attn_res_final_aggregation: bool = True
    # GLM-5.3-Flash indexer variants: k-pool keys, shared-indexer layers
    index_kpool: int = 1
    index_kpool_always_select_tail: bool = True
    indexer_types: list[str] | None = None
    # GLM-5.3-Flash (glm5_next): KDA gate lower bound, SwiGLU clamp, mHC hyper-connections
    linear_lower_bound: float | None = None
    swiglu_limit: float | None = None
    hc_mult: int = 1
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # Kimi K3 (kimi_k3 / kimi_linear text config): gated MLA, full-rank KDA output gate, LatentMoE, SiTU, MXFP4 experts
    mla_use_output_gate: bool = False
    linear_use_full_rank_gate: bool = False
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    routed_expert_weight_format: str = "dense"
    # Kernels
    kernel_backend: str = "auto"
    # MoE training outputs (transformers' Mixtral / Glm5Next names): router logits and the load-balancing loss
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    # Multi-token prediction (DeepSeek-V3 MTP / "nextn" layers, modeling_kdsa.mtp)
    num_mtp_layers: int = 0

    def __post_init__(self, **kwargs):
        # transformers only warns when a config.json of another model type is loaded into this class, then keeps the
        # fields whose names match: a Kimi-Linear or DeepSeek-V3.2 folder would load with missing and unexpected
        # tensors freshly initialised, i.e. silently wrong. Refuse instead; conversion.py translates such configs
        # field by field and passes the result in as a KDSAConfig.
        source_type = kwargs.get("model_type", self.model_type)
        if source_type != self.model_type:
            raise ValueError(
                f"this config describes a {source_type!r} model, not {self.model_type!r}: KDSAConfig does not read "
                "other model types' fields. KDSAForCausalLM.from_pretrained(local_folder) converts the family's "
                "checkpoints (docs/checkpoint-conversion.md §1); AutoModelForCausalLM.from_pretrained(path) loads "
                "transformers' own class"
            )
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

    def _check_per_layer(self, name: str, allowed: tuple[str, ...], meanings: str = "") -> None:
        """A per-layer list field (`layer_types`, ...) has one entry per layer, each one of `allowed`."""
        values = getattr(self, name)
        if len(values) != self.num_hidden_layers:
            raise ValueError(f"{name} has {len(values)} entries but num_hidden_layers is {self.num_hidden_layers}")
        for i, value in enumerate(values):
            if value not in allowed:
                raise ValueError(f"{name}[{i}] = {value!r} is not supported; use one of {allowed}{meanings}")

    def _check_consistency(self):
        """Raise a `ValueError` naming the offending field (docs/design.md §6). Runs before transformers' validators,
        whose errors are not `ValueError`s."""
        self._check_per_layer(
            "layer_types",
            SUPPORTED_LAYER_TYPES,
            f" ('{KDA_LAYER}' = KDA, '{DSA_LAYER}' = DSA, '{MLA_LAYER}' = dense MLA)",
        )
        self._check_per_layer("mlp_layer_types", ("dense", "sparse"))
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
        if self.mla_layernorm_eps is not None and not self.mla_layernorm_eps > 0:
            raise ValueError(f"mla_layernorm_eps must be None (= rms_norm_eps) or > 0, got {self.mla_layernorm_eps}")
        self._check_group_routing()
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.attn_res_block_size < 0:
            raise ValueError(f"attn_res_block_size must be >= 0 (0 = plain residual), got {self.attn_res_block_size}")
        self._check_indexer_variants()
        self._check_glm_fields()
        self._check_k3_fields()
        if isinstance(self.num_mtp_layers, bool) or self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers must be an int >= 0 (0 = no MTP layers), got {self.num_mtp_layers!r}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        # The Triton indexer scores one key per token (docs/backends.md §4).
        if self.kernel_backend == "triton" and self.index_kpool > 1:
            raise ValueError(
                f"kernel_backend='triton' does not support the k-pool indexer (index_kpool={self.index_kpool}); use "
                "kernel_backend 'cpu', 'compiled', 'torch' or 'npu'"
            )

    def mtp_layer_type(self) -> str:
        """The token mixer of the MTP blocks: DSA (with the trunk's indexer settings, k-pool included) when the trunk
        has DSA layers, as DeepSeek-V3.2 and GLM-5.3-Flash ship them; dense MLA for a trunk without any (a Kimi
        trunk). A trunk of KDA layers only has no attention layer kind to copy: refused by name."""
        if DSA_LAYER in self.layer_types:
            return DSA_LAYER
        if MLA_LAYER in self.layer_types:
            return MLA_LAYER
        raise ValueError(
            f"num_mtp_layers={self.num_mtp_layers} needs a DSA or dense MLA layer in layer_types to copy the MTP "
            "block's attention from; this trunk has KDA layers only"
        )

    def mtp_config(self) -> "KDSAConfig":
        """The configuration of the MTP blocks, as a `KDSAConfig` whose `num_mtp_layers` decoder layers are one block
        each: the trunk's fields with every layer an attention (`mtp_layer_type`, own indexer) + MoE ("sparse")
        layer on the plain residual stream (`attn_res_block_size=0`, `hc_mult=1`: DeepSeek's MTP block; GLM-5.3-Flash
        ships its MTP layer single-stream), `first_k_dense_replace=0` and no MTP layers of its own."""
        if self.num_mtp_layers < 1:
            raise ValueError("mtp_config() needs num_mtp_layers >= 1")
        fields = self.to_dict()
        for name in ("model_type", "transformers_version", "architectures", "auto_map", "qk_head_dim", "head_dim"):
            fields.pop(name, None)
        n = self.num_mtp_layers
        fields.update(
            num_hidden_layers=n,
            layer_types=[self.mtp_layer_type()] * n,
            mlp_layer_types=["sparse"] * n,
            indexer_types=["full"] * n,
            first_k_dense_replace=0,
            attn_res_block_size=0,
            hc_mult=1,
            num_mtp_layers=0,
        )
        return KDSAConfig(**fields)

    def _check_group_routing(self):
        if self.n_group <= 0 or self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must be > 0 and divide n_routed_experts ({self.n_routed_experts})"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]")
        experts_per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and experts_per_group < 2:
            raise ValueError(
                f"n_group={self.n_group} leaves {experts_per_group} expert per group; a group is scored by its two "
                "best experts, so each group needs >= 2 (n_routed_experts / n_group)"
            )
        if self.num_experts_per_tok > self.topk_group * experts_per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of topk_group={self.topk_group} "
                f"groups ({self.topk_group} x {experts_per_group})"
            )

    def _check_glm_fields(self):
        """GLM-5.3-Flash fields: KDA gate lower bound, SwiGLU clamp, mHC."""
        if self.linear_lower_bound is not None and not self.linear_lower_bound < 0:
            raise ValueError(
                f"linear_lower_bound must be None or < 0 (the lowest KDA log decay), got {self.linear_lower_bound}"
            )
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be None or > 0, got {self.swiglu_limit}")
        if self.hc_mult < 1:
            raise ValueError(f"hc_mult must be >= 1 (1 = no hyper-connections), got {self.hc_mult}")
        if self.hc_eps < 0:
            raise ValueError(f"hc_eps must be >= 0, got {self.hc_eps}")
        if self.hc_sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {self.hc_sinkhorn_iters}")
        if self.hc_mult > 1 and self.attn_res_block_size > 0:
            raise ValueError(
                f"hc_mult={self.hc_mult} (mHC hyper-connections) and attn_res_block_size={self.attn_res_block_size} "
                "(Block AttnRes) both replace the residual stream; set attn_res_block_size=0 to use mHC"
            )

    def _check_k3_fields(self):
        """Kimi K3 fields: LatentMoE, SiTU, MXFP4 routed experts (docs/kimi-k3.md)."""
        latent = self.routed_expert_hidden_size
        if latent is not None and latent <= 0:
            raise ValueError(f"routed_expert_hidden_size must be None (no LatentMoE) or > 0, got {latent}")
        if self.latent_moe_use_norm and latent is None:
            raise ValueError(
                "latent_moe_use_norm=True needs routed_expert_hidden_size (the latent width it normalises)"
            )
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hidden_act == "situ" and self.swiglu_limit is not None:
            raise ValueError(
                f"swiglu_limit={self.swiglu_limit} clamps SwiGLU; it cannot be combined with hidden_act='situ'"
            )
        if self.routed_expert_weight_format not in ROUTED_EXPERT_WEIGHT_FORMATS:
            raise ValueError(
                f"routed_expert_weight_format must be one of {ROUTED_EXPERT_WEIGHT_FORMATS}, got "
                f"{self.routed_expert_weight_format!r}"
            )
        if self.routed_expert_weight_format == "mxfp4":
            expert_width = self.hidden_size if latent is None else latent
            for name, width in (
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("expert input width", expert_width),
            ):
                if width % 32:
                    raise ValueError(
                        f"routed_expert_weight_format='mxfp4' scales groups of 32 input columns: {name} ({width}) must "
                        "be a multiple of 32"
                    )

    def _check_indexer_variants(self):
        """GLM-5.3-Flash indexer fields (docs/dsa.md §9, §10)."""
        if self.index_kpool < 1:
            raise ValueError(f"index_kpool must be >= 1 (1 = one indexer key per token), got {self.index_kpool}")
        if self.index_topk % self.index_kpool:
            raise ValueError(
                f"index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool}): top-k "
                "selects whole pools"
            )
        if self.index_kpool > 1 and self.qk_rope_head_dim:
            raise ValueError(
                f"index_kpool={self.index_kpool} needs NoPE (qk_rope_head_dim=0, as GLM-5.3-Flash): pooling keys "
                f"rotated at different positions is not defined; got qk_rope_head_dim={self.qk_rope_head_dim}"
            )
        self._check_per_layer("indexer_types", ("full", "shared"))
        for i, indexer_type in enumerate(self.indexer_types):
            if indexer_type != "shared" or self.layer_types[i] != DSA_LAYER:
                continue
            # transformers' Glm5Next hands a selection only from a full DSA layer to the layer right after it.
            if i == 0 or self.layer_types[i - 1] != DSA_LAYER or self.indexer_types[i - 1] != "full":
                raise ValueError(
                    f"indexer_types[{i}] = 'shared' but layer {i - 1} is not a DSA layer with its own indexer: a "
                    "shared DSA layer reuses the top-k of the layer right before it, which must be 'full'"
                )


__all__ = ["KDSAConfig"]
