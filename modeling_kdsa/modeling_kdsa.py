"""KDSA model: KDA, DSA and dense MLA token mixers interleaved per `config.layer_types`, MoE feed-forward, and one
of three residual streams: plain, Block AttnRes or mHC hyper-connections.

Reads top to bottom: pretrained base (init, flags) → model → causal-LM head; the decoder layer and the plain residual
stream are in `decoder_layer.py`.
The mixers live in `kda.py` (docs/kda.md) and `dsa.py` (docs/dsa.md), the feed-forward in `moe.py`, the
depth attention in `attn_res.py` (docs/attn-res.md), the hyper-connections in `hyper_connections.py`
(docs/hyper-connections.md). docs/design.md §2.
"""

import copy
import json
import math
import os
import re

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init
from transformers.generation import GenerationMixin, GenerationMode
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg

from .attn_res import BlockAttnResStream, KDSADepthAttention
from .cache import ROLLBACK_TOKENS, KDSACache
from .configuration_kdsa import DSA_LAYER, MLA_LAYER, KDSAConfig
from .conversion import (
    _KDSA_ONLY_FIELDS,
    FOREIGN_MODEL_TYPES,
    REGISTRATION_LOCK,
    checkpoint_keys,
    load_foreign,
    plan_foreign_load,
)
from .decoder_layer import KDSADecoderLayer, PlainResidualStream
from .dsa import KDSAIndexer
from .embedding import KDSAEmbedding
from .fp8_linear import KDSAFP8Linear
from .hyper_connections import HyperConnectionStream, KDSAHyperConnection
from .kda import KDSAKimiDeltaAttention
from .linear import KDSALinear
from .modeling_validation import check_forward_inputs, check_input_embeddings, check_sequence_parallel, padding_mask
from .moe import KDSAExperts, KDSATopkRouter, load_balancing_loss
from .mtp import KDSAMultiTokenPredictor
from .norms import KDSARMSNorm
from .numeric_formats import mxfp4_quantize
from .rotary import KDSARotaryEmbedding
from .sequence_parallel import SequenceParallelContext
from .speculative import SPECULATION_OPTIONS, sharded_group, speculative_generate
from .static_cache import KDSAStaticCache
from .stop_strings import VocabularyProbeStopStringCriteria, stop_string_probe

logger = logging.get_logger(__name__)


def _has_expert_parallel_layers(model) -> bool:
    """Whether some MoE layer runs its experts by expert parallelism (`modeling_kdsa.parallel`'s
    `ExpertParallelExperts`, found by attribute: these files also ship as remote code, without that package)."""
    return any(hasattr(module, "local_experts") for module in model.modules())


class KDSAPreTrainedModel(PreTrainedModel):
    config: KDSAConfig
    config_class = KDSAConfig
    base_model_prefix = "model"
    # The decoder layers replay from a copy of the residual stream (docs/design.md §10); non-reentrant only.
    supports_gradient_checkpointing = True
    _no_split_modules = ["KDSADecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    # transformers refuses assisted generation / prompt lookup for stateful models because `crop` cannot undo a
    # recurrent state. KDSACache's `crop` can: KDA layers replay their recorded steps from a checkpoint (cache.py).
    _is_stateful = False
    # With `KDSAStaticCache` (cache_implementation="static") the decode step compiles with fullgraph=True
    # (docs/graph-mode.md §2); transformers itself only reads this flag in its own tests.
    _can_compile_fullgraph = True
    # Gates, decay parameters, indexer head weights, router, depth-attention queries and the mHC biases and gains
    # stay fp32 under bf16 loads.
    _keep_in_fp32_modules_strict = [
        "A_log",
        "dt_bias",
        "indexer.weights_proj",
        "mlp.gate.weight",
        "e_score_correction_bias",
        "attention_res",
        "mlp_res",
        "output_attn_res",
        "attn_hc.base",
        "attn_hc.scale",
        "ffn_hc.base",
        "ffn_hc.scale",
    ]

    def post_init(self):
        """transformers' post_init, then `_keep_in_fp32_modules_strict` narrowed to the entries this configuration
        builds: the class lists every optional component's fp32 parameters (mHC, AttnRes), and transformers expects
        each entry to name a module of the model (matched as its loader matches them: a dotted name component)."""
        super().post_init()
        names = [name for name, _ in self.named_parameters()] + [name for name, _ in self.named_buffers()]
        self._keep_in_fp32_modules_strict = {
            entry
            for entry in self._keep_in_fp32_modules_strict
            if any(re.search(rf"(?:^|\.){re.escape(entry)}(?:\.|$)", name) for name in names)
        }

    def save_pretrained(self, save_directory, *args, **kwargs):
        """A sharded model (`tp_plan="auto"`, `DistributedConfig(tp_size=N)`, `distributed_config={"tp_size": …,
        "ep_size": …}`, or `apply_tensor_parallel` / `apply_expert_parallel`) saves the whole model: every rank calls
        it, the cut tensors are gathered over the tp group and the routed experts over the ep group, and global rank 0
        writes the folder, which loads in one process or sharded again (docs/parallel.md §10). Refused for FP8-held
        weights (`fp8_weights="hold"`: KDSA's native format has no FP8 weight layout, docs/checkpoint-conversion.md
        §9)."""
        if any(isinstance(module, KDSAFP8Linear) for module in self.modules()):
            raise ValueError(
                "save_pretrained of a model loaded with fp8_weights='hold' is not supported: the native KDSA format "
                "has no FP8 weights. Load the folder with fp8_weights='dequantize' (the default) to save it"
            )
        return super().save_pretrained(save_directory, *args, **kwargs)

    def gather_sharded_state_dict_for_save(self, model_to_save, state_dict, distributed_config, **kwargs):
        """transformers' hook in save_pretrained: a KDSA model sharded by its own plans (modeling_kdsa.parallel)
        holds plain local pieces, tp cuts and each ep rank's experts, which transformers' DTensor gather cannot put
        back together."""
        tp_group, expert_parallel = sharded_group(model_to_save), _has_expert_parallel_layers(model_to_save)
        if tp_group is None and not expert_parallel:
            return super().gather_sharded_state_dict_for_save(model_to_save, state_dict, distributed_config, **kwargs)
        try:  # on demand, in a try: these files also ship as remote code, without the parallel package
            from modeling_kdsa.parallel.expert_parallel import gather_expert_parallel_state_dict
            from modeling_kdsa.parallel.hf_plans import finish_tensor_parallel_load
            from modeling_kdsa.parallel.tensor_parallel import gather_whole_state_dict
        except ImportError as error:
            raise ValueError("saving a sharded model needs the kdsa package: modeling_kdsa.parallel") from error
        if tp_group is not None and not expert_parallel:
            # A tp load not finished by KDSAForCausalLM.from_pretrained (a base model through AutoModel) holds DTensors
            # until its first forward (parallel/hf_plans.py); finishing is idempotent.
            finish_tensor_parallel_load(model_to_save)
            current = model_to_save.state_dict()
            state_dict = {name: current.get(name, tensor) for name, tensor in state_dict.items()}
        whole = state_dict if tp_group is None else gather_whole_state_dict(model_to_save, state_dict, tp_group)
        whole = gather_expert_parallel_state_dict(model_to_save, whole)
        return whole if kwargs.get("save_on_this_rank", True) else {}

    def barrier_after_gathered_checkpoint_save(self, distributed_config) -> None:
        """The ranks that did not write wait for the one that did, for every sharded model."""
        if sharded_group(self) is not None or _has_expert_parallel_layers(self):
            torch.distributed.barrier()
        else:
            super().barrier_after_gathered_checkpoint_save(distributed_config)

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func=checkpoint, every_n_layers: int = 1
    ):
        """transformers' switch (`gradient_checkpointing_enable`), refusing reentrant checkpointing: it passes
        gradients only through tensor arguments, and a layer's input is a residual-stream object
        (docs/design.md §10), so the gradients would be silently wrong."""
        if enable and getattr(gradient_checkpointing_func, "keywords", {}).get("use_reentrant") is not False:
            raise ValueError(
                "KDSA supports only non-reentrant gradient checkpointing: pass gradient_checkpointing_kwargs="
                "{'use_reentrant': False} (transformers' default; torch's checkpoint treats an unset use_reentrant as "
                "True). Reentrant checkpointing back-propagates only through tensor arguments, and KDSA decoder "
                "layers take the residual stream as an object"
            )
        super()._set_gradient_checkpointing(enable, gradient_checkpointing_func, every_n_layers)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, nn.Conv1d):
            # The KDA short convolutions: PyTorch's default fan-in bound (fan-in = kernel width for depthwise), as
            # fla's ShortConvolution keeps it; the generic std=0.02 would nearly silence v.
            bound = 1.0 / math.sqrt(module.weight.shape[1] * module.weight.shape[2])
            init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, KDSAKimiDeltaAttention):
            # fla's KDA initialisation (docs/kda.md §2): A = U(1, 16), dt log-uniform in [1e-3, 1e-1]; with the
            # bounded gate A = 1 (A_log = 0), as GLM-5.3-Flash initialises it.
            if module.lower_bound is not None:
                init.zeros_(module.A_log)
            else:
                init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif isinstance(module, KDSADepthAttention):
            init.zeros_(module.query)  # zero-init: uniform depth average at step 0 (docs/attn-res.md §1)
        elif isinstance(module, KDSAHyperConnection):
            # Zero biases and unit gains: uniform-ish pre/post weights and mixing at step 0, as mHC starts.
            init.normal_(module.fn, mean=0.0, std=std)
            init.zeros_(module.base)
            init.ones_(module.scale)
        elif isinstance(module, KDSATopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KDSAExperts) and module.mxfp4:
            # Fresh MXFP4 experts: normal(0, std) weights in the spec's MXFP4 (loaded ones are never re-quantized).
            for name in ("gate_up_proj", "down_proj"):
                packed = getattr(module, f"{name}_packed")
                weights = torch.randn(*packed.shape[:-1], 2 * packed.shape[-1], device=packed.device) * std
                codes, scales = mxfp4_quantize(weights)
                init.copy_(packed, codes)
                init.copy_(getattr(module, f"{name}_scale"), scales)
        elif isinstance(module, KDSAExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KDSAIndexer) and module.index_kpool > 1:
            # GLM-5.3-Flash's initialisation: no position bias, equal gate weights (pooling starts near a mean).
            init.zeros_(module.index_kpool_compress_ape)
            init.ones_(module.index_kpool_compress_gate)


class KDSAModel(KDSAPreTrainedModel):
    def __init__(self, config: KDSAConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = KDSAEmbedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([KDSADecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = KDSARMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # RoPE tables only when some layer rotates: the indexer of a DSA layer always does, MLA unless mla_use_nope.
        rotated_types = {DSA_LAYER} if config.mla_use_nope else {DSA_LAYER, MLA_LAYER}
        uses_rope = config.qk_rope_head_dim > 0 and not rotated_types.isdisjoint(config.layer_types)
        self.rotary_emb = KDSARotaryEmbedding(config) if uses_rope else None
        if config.attn_res_block_size > 0 and config.attn_res_final_aggregation:
            self.output_attn_res = KDSADepthAttention(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable (docs/design.md §10)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KDSACache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        output_router_logits: bool | None = None,
        sequence_parallel: SequenceParallelContext | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        """`output_hidden_states`: the embeddings, then each layer's input as it reads it from the residual stream
        (with Block AttnRes: its depth-attended input), then the final normed output: `num_hidden_layers + 1`
        tensors, transformers' convention. `output_attentions` is refused: KDA and DSA form no attention matrix.
        `output_router_logits` (default `config.output_router_logits`): `router_logits`, one `[B·T, E]` fp32 tensor
        per MoE layer, in layer order (dense-MLP layers have none).

        `sequence_parallel` (context parallelism, docs/parallel.md §7): the input is this process's share of a
        sequence that starts here; positions, padding slots and the cross-token steps of the layers come from it, the
        outputs are the local tokens'. Only with an empty `KDSACache` (or none) and no `attention_mask`."""
        output_router_logits = (
            self.config.output_router_logits if output_router_logits is None else output_router_logits
        )
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and cache is not None:
            # The backward pass replays each layer: a cache would be written twice (transformers drops it likewise).
            logger.warning_once("a cache is incompatible with gradient checkpointing in training: using cache=None")
            cache, use_cache = None, False
        check_forward_inputs(self.config, input_ids, inputs_embeds, cache, output_attentions, output_router_logits)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        check_input_embeddings(inputs_embeds, cache)
        batch_size, seq_len, _ = inputs_embeds.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = KDSACache(self.config)
        token_mask = None
        if sequence_parallel is not None:
            check_sequence_parallel(sequence_parallel, seq_len, attention_mask, position_ids, cache)
            # Cache and positions count the whole sequence; KDA runs the padding slots as identity steps.
            token_mask = sequence_parallel.token_mask()[None].expand(batch_size, -1)
            position_ids = sequence_parallel.positions.clamp(min=0)[None].expand(batch_size, -1)  # padding: any
            seq_len = sequence_parallel.seq_len
        internal_cache = cache is None and torch.compiler.is_exporting()
        if internal_cache:
            # torch.export: a cache-less forward stages MLA keys in a paged store whose allocator is host code; a
            # static cache of the input's length gives the same attention with fixed shapes (docs/graph-mode.md §7).
            cache = KDSAStaticCache(self.config, max_cache_len=seq_len)
        if isinstance(cache, KDSAStaticCache):
            # Fixed shapes, no host sync (docs/graph-mode.md §2): the mask is padded to the capacity and the token
            # count is a 0-d tensor; the capacity check runs only eagerly.
            attention_mask = self._static_padding_mask(attention_mask, batch_size, cache.capacity)
            past_len = cache.begin_forward(seq_len, device=inputs_embeds.device)
            if attention_mask is not None:
                token_mask = self._static_token_mask(attention_mask, past_len, seq_len)
        else:
            past_len = cache.get_seq_length() if cache is not None else 0
            if past_len + seq_len > self.config.max_position_embeddings:
                # transformers' convention: the limit is the trained length, not a hard one (RoPE extends, and scaled
                # RoPE configs exist for exactly this); warn once and go on.
                logger.warning_once(
                    f"the sequence exceeds max_position_embeddings={self.config.max_position_embeddings}: positions "
                    "beyond the trained length may degrade the output"
                )
            attention_mask = padding_mask(attention_mask, batch_size, past_len + seq_len)
            if cache is not None:
                # Capacity check (raises before any layer writes), and the pages of every paged layer prepared here,
                # outside the layer loop: the page allocator is host code (docs/graph-mode.md §1).
                cache.begin_forward(seq_len, like=inputs_embeds)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=inputs_embeds.device) + past_len
            position_ids = position_ids.unsqueeze(0).expand(batch_size, -1)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids) if self.rotary_emb is not None else None

        stream = self.residual_stream(inputs_embeds)
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        all_hidden_states = [] if output_hidden_states else None
        all_router_logits = [] if output_router_logits else None
        topk_indices = None  # a DSA layer's selection, handed to the next layer when that one shares its indexer
        for layer in self.layers:
            # The stream goes positionally: under gradient checkpointing it is the replayed input (docs/design.md §10).
            stream, layer_input, topk_indices, router_logits = layer(
                stream,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                cache=cache,
                topk_indices=topk_indices,
                token_mask=token_mask,
                output_router_logits=output_router_logits,
                sequence_parallel=sequence_parallel,
            )
            if output_hidden_states:
                all_hidden_states.append(layer_input)
            if router_logits is not None:
                all_router_logits.append(router_logits)
        hidden_states = self.norm(stream.final(getattr(self, "output_attn_res", None)))
        if output_hidden_states:
            all_hidden_states.append(hidden_states)
        return MoeModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=cache if use_cache and not internal_cache else None,
            hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
            router_logits=tuple(all_router_logits) if output_router_logits else None,
        )

    def residual_stream(
        self, embeddings: torch.Tensor
    ) -> PlainResidualStream | BlockAttnResStream | HyperConnectionStream:
        """A fresh residual stream for one forward pass over `embeddings: [B, T, D]`, of the config's kind."""
        if self.config.hc_mult > 1:
            hyper_connections = [m for layer in self.layers for m in (layer.attn_hc, layer.ffn_hc)]
            return HyperConnectionStream(embeddings, hyper_connections)
        if self.config.attn_res_block_size > 0:
            depth_attentions = [m for layer in self.layers for m in (layer.attention_res, layer.mlp_res)]
            return BlockAttnResStream(
                embeddings, block_size=self.config.attn_res_block_size, depth_attns=depth_attentions, two_phase=True
            )
        return PlainResidualStream(embeddings)

    @staticmethod
    def _static_token_mask(padded_mask: torch.Tensor, past_len: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The current tokens' columns `[B, T]` of a capacity-padded mask; `past_len` is the 0-d count before them
        (a tensor: no host sync)."""
        current = past_len + torch.arange(seq_len, device=padded_mask.device)
        return padded_mask.gather(1, current.expand(padded_mask.shape[0], -1))

    @staticmethod
    def _static_padding_mask(
        attention_mask: torch.Tensor | None, batch_size: int, capacity: int
    ) -> torch.Tensor | None:
        """The 2-D padding mask for a `KDSAStaticCache`: `[B, S]` with `S <= capacity` (past + new tokens, or
        already padded by `create_masks_for_generate`), returned as bool `[B, capacity]`, False past `S`."""
        if attention_mask is None:
            return None
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or attention_mask.shape[1] > capacity:
            raise ValueError(
                f"KDSAStaticCache takes a 2-D padding mask [batch={batch_size}, <= capacity={capacity}]; got shape "
                f"{tuple(attention_mask.shape)}"
            )
        return torch.nn.functional.pad(attention_mask.bool(), (0, capacity - attention_mask.shape[1]))


def _tensor_parallel_loading(cls, path, kwargs: dict):
    """modeling_kdsa.parallel.hf_plans when from_pretrained's arguments ask for tensor or expert parallelism over more
    than one rank, after its layout checks against the checkpoint's config; None otherwise. Imported here, on demand:
    these model files also ship as remote code, without the parallel package (docs/parallel.md §10)."""
    if all(kwargs.get(name) is None for name in ("tp_plan", "tp_size", "distributed_config")):
        return None
    try:
        from modeling_kdsa.parallel import hf_plans
    except ImportError as error:
        raise ValueError(
            "tensor-parallel loading needs the kdsa package installed: its parallel styles are "
            "modeling_kdsa.parallel (docs/parallel.md §10)"
        ) from error
    config, foreign_plan = kwargs.get("config"), None
    if not isinstance(config, KDSAConfig):
        config_file = os.path.join(str(path), "config.json")
        raw_config = {}
        if os.path.isfile(config_file):  # foreign families load from local folders only (conversion.py)
            with open(config_file) as f:
                raw_config = json.load(f)
        if raw_config.get("model_type") in FOREIGN_MODEL_TYPES:
            overrides = {name: kwargs[name] for name in _KDSA_ONLY_FIELDS if name in kwargs}
            foreign_plan = plan_foreign_load(raw_config, checkpoint_keys(str(path)), overrides)
            config = foreign_plan.config
        else:
            fields = {name: value for name, value in kwargs.items() if name in KDSAConfig.__dataclass_fields__}
            config = KDSAConfig.from_pretrained(path, **fields)
    return hf_plans if hf_plans.check_tensor_parallel_load(config, kwargs, foreign_plan) else None


class KDSAForCausalLM(KDSAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Under tensor parallelism the head is cut by vocabulary rows, as the embedding is (`base_model_tp_plan`), and its
    # logits are all-gathered (parallel/hf_plans.py). A tied head is cut by its own plan too and tied back to the cut
    # embedding after the load (docs/parallel.md §5).
    _tp_plan = {"lm_head": "kdsa_vocab_head"}
    # module name -> FP8 block: layers built as KDSAFP8Linear (docs/checkpoint-conversion.md §9); set by load_foreign.
    _fp8_held_layers: dict = {}

    def __init__(self, config: KDSAConfig):
        super().__init__(config)
        self.model = KDSAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = KDSALinear(
            config.hidden_size, config.vocab_size, bias=False, kernel_backend=config.kernel_backend
        )
        # The MTP layers (docs/checkpoint-conversion.md §10): draft layers the forward pass never runs; they share
        # the embedding and lm_head with the model (read at each call, saved once).
        self.mtp = KDSAMultiTokenPredictor(config) if config.num_mtp_layers > 0 else None
        if self.mtp is not None:
            self.mtp.bind(self)
        for name, block in self._fp8_held_layers.items():  # set only while an FP8 folder loads (conversion.py)
            self.set_submodule(name, KDSAFP8Linear.like(self.get_submodule(name), block))
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Also loads a local folder of a published family checkpoint (config.json `model_type` `deepseek_v32`,
        `kimi_linear`, `glm5_next` or `kimi_k3`), converting config and weights at load (conversion.py,
        docs/checkpoint-conversion.md §1); any field or tensor KDSA cannot reproduce is a ValueError.
        Tensor parallelism through transformers (`tp_plan="auto"` or `distributed_config=DistributedConfig(tp_size=N)`,
        one process per rank) loads each rank's shard only, cut by modeling_kdsa.parallel's styles; a bad layout is a
        ValueError on every rank before the load starts (docs/parallel.md §10)."""
        tensor_parallel = _tensor_parallel_loading(cls, pretrained_model_name_or_path, kwargs)
        loaded = cls._load_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if tensor_parallel is not None:
            tensor_parallel.finish_tensor_parallel_load(loaded[0] if isinstance(loaded, tuple) else loaded)
        return loaded

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """transformers' hook between building the meta model and reading the weights. KDSA's own loads
        (modeling_kdsa.parallel's `ShardedLoad`, `ExpertParallelLoad`) first mark the FP8 weights read whole; an
        expert-parallel load then cuts the meta model here, so that each rank reads only its experts
        (docs/parallel.md §10)."""
        prepare = getattr(distributed_config, "prepare_meta_model", None)
        if prepare is not None:
            prepare(model)
        model = super().maybe_distribute_model(model, distributed_config, mesh_manager)
        distribute = getattr(distributed_config, "distribute_meta_model", None)
        return model if distribute is None else distribute(model)

    @classmethod
    def _load_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        config_file = os.path.join(str(pretrained_model_name_or_path), "config.json")
        if kwargs.get("config") is None and os.path.isfile(config_file):
            with open(config_file) as f:
                raw_config = json.load(f)
            if raw_config.get("model_type") in FOREIGN_MODEL_TYPES:
                return load_foreign(cls, str(pretrained_model_name_or_path), raw_config, model_args, kwargs)
        if "fp8_weights" in kwargs:
            raise ValueError(
                "fp8_weights= applies to FP8 checkpoints of deepseek_v32 / glm5_next folders only "
                "(docs/checkpoint-conversion.md §9); this is not one"
            )
        want_info = kwargs.pop("output_loading_info", False)
        with REGISTRATION_LOCK:  # never while a foreign load has its conversions registered
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        # transformers initialises missing tensors at random and only warns: MTP layers that the config declares
        # but the checkpoint lacks would draft garbage (docs/checkpoint-conversion.md §10).
        missing_mtp = sorted(key for key in info.get("missing_keys", ()) if key.startswith("mtp."))
        if missing_mtp:
            raise ValueError(
                f"{pretrained_model_name_or_path}: config.json declares num_mtp_layers={model.config.num_mtp_layers} "
                f"but the checkpoint lacks MTP tensors {missing_mtp}; pass num_mtp_layers=0 to load without MTP layers"
            )
        return (model, info) if want_info else model

    def _get_stopping_criteria(self, generation_config, stopping_criteria, tokenizer=None):
        """transformers' criteria, with `stop_strings` matched through `VocabularyProbeStopStringCriteria` when the
        tokenizer cannot spell transformers' probe text (word-level vocabularies such as the shipped checkpoints';
        stop_strings.py)."""
        probe = None
        if generation_config.stop_strings is not None and tokenizer is not None:
            probe = stop_string_probe(tokenizer)
        if probe is None:
            return super()._get_stopping_criteria(generation_config, stopping_criteria, tokenizer)
        without_stop_strings = copy.copy(generation_config)
        without_stop_strings.stop_strings = None
        criteria = super()._get_stopping_criteria(without_stop_strings, stopping_criteria, tokenizer)
        criteria.append(VocabularyProbeStopStringCriteria(tokenizer, generation_config.stop_strings, probe))
        return criteria

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
    ):
        """generate() builds a `DynamicCache` by default; KDSA layers need the paged `KDSACache`. Only speculative
        decoding crops — the verifying model (assisted mode) and the draft model (`is_assistant`) — so only there
        do the KDA layers keep rollback records; every other mode runs without their cost.

        `cache_implementation="static"` builds a `KDSAStaticCache` (fixed capacity, compileable: generate then
        compiles the decode step with `generation_config.compile_config`; docs/graph-mode.md §2) of capacity
        `max(max_length, generation_config.max_cache_len, the previous static capacity)`, the last term so that
        repeated calls keep one compiled graph, as transformers' static caches do. A `KDSAStaticCache` passed in
        (`cache=`) must hold the prompt and the new tokens: checked here, before the prefill."""
        given = model_kwargs.get("cache")
        if isinstance(given, KDSAStaticCache) and max_cache_length > given.max_cache_len:
            raise ValueError(
                f"generate() needs {max_cache_length} cache slots (prompt + max_new_tokens - 1); the KDSAStaticCache "
                f"passed has max_cache_len={given.max_cache_len}"
            )
        if given is None and generation_config.use_cache is not False:
            implementation = generation_config.cache_implementation
            crops = generation_mode == GenerationMode.ASSISTED_GENERATION or generation_config.is_assistant
            if implementation == "static":
                if crops:
                    raise ValueError(
                        "cache_implementation='static' does not support speculative decoding (assisted generation, "
                        "prompt lookup, draft models): KDSAStaticCache cannot crop; use cache_implementation=None"
                    )
                if generation_config.num_beams > 1:
                    raise ValueError(
                        "cache_implementation='static' does not support beam search (num_beams > 1): KDSAStaticCache "
                        "cannot reorder; use cache_implementation=None"
                    )
                capacity = max(max_cache_length, generation_config.max_cache_len or 0)
                capacity = max(capacity, getattr(self, "_previous_max_cache_length", 0))
                model_kwargs["cache"] = KDSAStaticCache(self.config, max_cache_len=capacity)
                self._previous_max_cache_length = capacity
                return
            if implementation not in (None, "dynamic"):
                raise ValueError(
                    f"cache_implementation={implementation!r} is not supported: KDSA models generate with their own "
                    "paged KDSACache (default) or the fixed-capacity KDSAStaticCache ('static')"
                )
            model_kwargs["cache"] = KDSACache(self.config, rollback_tokens=ROLLBACK_TOKENS if crops else 0)
            return
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
        )

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """transformers' criteria for compiling the decode step, except over a static cache that carries a
        decode-step package (modeling_kdsa.aot): its steps are already compiled, and a compiled forward would trace
        the model's own step instead (docs/graph-mode.md §14)."""
        if getattr(model_kwargs.get("cache"), "decode_step", None) is not None:
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    def _prepare_generation_config(self, generation_config, **kwargs):
        """transformers' preparation, plus KDSA's drafting options (`SPECULATION_OPTIONS`: `mtp_draft_tokens`,
        `dspark_confidence_threshold`, `draft_schedule`), taken from `generate()`'s keywords onto the call's
        generation config."""
        options = {name: kwargs.pop(name) for name in SPECULATION_OPTIONS if name in kwargs}
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        for name, value in options.items():
            setattr(generation_config, name, value)
        return generation_config, model_kwargs

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        """transformers' checks, plus: `speculation_type="dspark"` without a draft, and a drafting option without its
        drafter, are refused (transformers would decode plainly and ignore them)."""
        if generation_config.speculation_type not in (None, "dspark"):
            raise ValueError(
                f"speculation_type={generation_config.speculation_type!r} is not supported by KDSA models: use "
                "speculation_type='dspark' with a DSparkDraftModel, use_mtp=True, an assistant_model or "
                "prompt_lookup_num_tokens"
            )
        if generation_config.speculation_type == "dspark" and generation_mode_kwargs.get("assistant_model") is None:
            raise ValueError(
                "speculation_type='dspark' needs assistant_model=<a DSparkDraftModel> "
                "(modeling_kdsa.DSparkDraftModel.from_pretrained(folder))"
            )
        mtp, dspark = bool(generation_config.use_mtp), generation_config.speculation_type == "dspark"
        drafters = {"mtp_draft_tokens": ("use_mtp=True", mtp),
                    "dspark_confidence_threshold": ("speculation_type='dspark'", dspark),
                    "draft_schedule": ("use_mtp=True and speculation_type='dspark'", mtp or dspark)}  # fmt: skip
        for name, (flag, active) in drafters.items():
            if getattr(generation_config, name, None) is not None and not active:
                raise ValueError(f"{name} applies to {flag} only")
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        """`use_mtp=True` (the checkpoint's MTP layers) and `speculation_type="dspark"` (a `DSparkDraftModel` as
        `assistant_model`) run KDSA's own block-drafting loop (speculative.py, docs/speculative.md), batched;
        assisted decoding with another model and prompt lookup stay transformers' own. None of them runs under
        expert parallelism."""
        if getattr(self, "expert_parallel_group", None) is not None:
            raise ValueError(
                "speculative decoding (use_mtp, dspark, prompt lookup, an assistant model) is not supported under "
                "expert parallelism: the ep ranks decode different sequences, accept different numbers of drafts and "
                "would call the expert all-to-alls a different number of times (docs/parallel.md §12)"
            )
        if generation_config.use_mtp or generation_config.speculation_type == "dspark":
            return speculative_generate(
                self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs
            )
        return super()._assisted_decoding(input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (`generate_batch`, `ContinuousBatchingManager`, `transformers serve
        --continuous-batching`) is refused here, where every entry point passes (docs/design.md §11)."""
        raise ValueError(
            "continuous batching (generate_batch / init_continuous_batching) is not supported: transformers' "
            "ContinuousBatchingManager pages only per-head K/V of 'full_attention' / 'sliding_attention' layers and "
            "runs packed ragged batches through its attention kernels; KDA layers keep a recurrent state and DSA / "
            "MLA layers a latent + indexer cache (KDSACache). Use generate() with a batch (left padding)"
        )

    def create_masks_for_generate(self, config, inputs_embeds, attention_mask, cache, **kwargs):
        """What generate() passes a compileable cache as the mask (instead of transformers' per-layer-type 4-D masks):
        KDSA takes the 2-D padding mask, padded to the static capacity so that its shape never changes between decode
        steps (docs/graph-mode.md §2). None stays None (nothing padded)."""
        if attention_mask is None or not isinstance(cache, KDSAStaticCache):
            return attention_mask
        return self.model._static_padding_mask(attention_mask, attention_mask.shape[0], cache.capacity)

    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        """transformers' positions (from the attention mask's cumsum), after checking that a 2-D mask covers the
        sequence: one entry per token, or per cached + new token when only the new tokens are passed. generate would
        otherwise use a longer mask silently and fail inside RoPE on a shorter one."""
        ids = model_kwargs.get("input_ids")
        length = ids.shape[1] if ids is not None and ids.shape[1] > 0 else inputs_tensor.shape[1]
        cache = model_kwargs.get("cache")
        past = cache.get_seq_length() if cache is not None else 0
        mask = model_kwargs.get("attention_mask")
        if past and length <= past and (mask is None or mask.shape[-1] == length):
            # transformers would feed the last `length - past` (<= 0) tokens: nothing, or a wrong slice.
            raise ValueError(
                f"the cache already holds {past} tokens and the prompt has {length}: generate() continues a used "
                "cache with the tokens after the cached ones. Pass a prompt that extends them (or only the new tokens "
                "with the whole sequence's attention_mask), or a fresh KDSACache / cache.reset()"
            )
        if mask is not None and mask.dim() == 2:
            if mask.shape[1] not in (length, past + length):
                raise ValueError(
                    f"attention_mask has {mask.shape[1]} positions but the input has {length} tokens"
                    + (f" ({past} more in the cache)" if past else "")
                    + ": pass the mask the tokenizer returned with the input (one entry per token)"
                )
        return super()._prepare_position_ids_for_generation(inputs_tensor, model_kwargs)

    @staticmethod
    def _runs_decode_step(cache, input_ids, labels, output_hidden_states, output_router_logits) -> bool:
        """Whether this forward is a plain one-token step over a static cache that carries a decode-step package:
        logits only, no loss or extra outputs, not inside a compiled graph (generate()'s own compiled step)."""
        return (
            isinstance(cache, KDSAStaticCache)
            and cache.decode_step is not None
            and input_ids is not None
            and input_ids.shape[1] == 1
            and labels is None
            and not output_hidden_states
            and not output_router_logits
            and not torch.compiler.is_compiling()
        )

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KDSACache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        """transformers' MoE causal-LM forward. With `output_router_logits` (default `config.output_router_logits`):
        `router_logits` per MoE layer and `aux_loss`, the load-balancing loss over the current tokens (padding left
        out), added to `loss` times `config.router_aux_loss_coef` when `labels` are given (docs/design.md §9)."""
        if kwargs.get("sequence_parallel") is not None:
            # `**kwargs` would swallow it and run the local share as if it were the whole sequence.
            raise ValueError(
                "KDSAForCausalLM.forward takes no sequence_parallel (its labels, loss and logits assume the whole "
                "sequence): run a context-parallel prefill with parallel.context_parallel_prefill, or call "
                "KDSAModel.forward(..., sequence_parallel=) (docs/parallel.md §7)"
            )
        output_router_logits = (
            self.config.output_router_logits if output_router_logits is None else output_router_logits
        )
        if self._runs_decode_step(cache, input_ids, labels, output_hidden_states, output_router_logits):
            # A decode-step package bound to this static cache (modeling_kdsa.aot; docs/graph-mode.md §14).
            mask = self.model._static_padding_mask(attention_mask, input_ids.shape[0], cache.capacity)
            logits = cache.decode_step(input_ids, mask, position_ids, model=self)
            return MoeCausalLMOutputWithPast(logits=logits, cache=cache)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            output_router_logits=output_router_logits,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        aux_loss = None
        if output_router_logits:
            token_mask, seq_len = None, hidden_states.shape[1]
            if attention_mask is not None and isinstance(cache, KDSAStaticCache):
                # The mask is padded to the capacity: the current tokens sit after the count the forward started at.
                padded = self.model._static_padding_mask(attention_mask, attention_mask.shape[0], cache.capacity)
                token_mask = self.model._static_token_mask(padded, cache.get_seq_length() - seq_len, seq_len)
            elif attention_mask is not None:
                token_mask = attention_mask[:, -seq_len:]
            aux_loss = load_balancing_loss(outputs.router_logits, self.config.num_experts_per_tok, token_mask)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits,
        )


__all__ = ["KDSAPreTrainedModel", "KDSAModel", "KDSAForCausalLM"]
