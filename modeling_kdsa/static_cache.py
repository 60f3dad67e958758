"""KDSAStaticCache: the fixed-capacity, compileable cache of a KDSA model (docs/graph-mode.md §2, §3).

`generate(..., cache_implementation="static")` builds it (KDSAForCausalLM._prepare_cache_for_generation), which makes
transformers compile the decode step (`generation_config.compile_config`; on CPU `CompileConfig(
_compile_all_devices=True)`). Everything a compiled step touches has a shape fixed by the capacity, never by the
context, and lives at a fixed address, so one graph serves every step of a growing context:

- KDA layers (`StaticKDALayer`): conv window `[B, C, W]` and fp32 state `[B, H, K, V]` allocated at the first write and
  updated in place (`copy_`).
- DSA and dense MLA layers (`StaticPagedLayer`, `StaticPagedMLALayer`): a page pool of `B · ceil(L / P)` pages for
  capacity `L`, allocated at the first write, a block table mapped once (sequence `b` owns pages `b·n … b·n + n-1`) and
  the token count as a 0-d int64 tensor. Writes are `index_copy_` at slots computed from that tensor.
- DSA layers with the k-pool indexer (`StaticKPoolLayer`, docs/dsa.md §9): the same pages plus a pooled-key slot for
  every group of `kp` tokens; a forward writes the pools it completes through a fixed number of candidates, the pool
  origin coming from the capacity-padded mask.
- Reads inside a compiled region use the fixed-shape kernels (`static_*` of the kernel registry's set, kernels.py;
  docs/graph-mode.md §3; the attention layer runs them, the store's page views say which: `PageView.fixed_shape`):
  the indexer scores all `L` slots under a mask (causal, end of the context, padding) and keeps
  `min(index_topk, L)` with the -1 sentinel (the k-pool indexer: all `L / kp` pool slots); dense MLA attends over all
  `L` slots under the same mask. Eager forwards (prefill, or an uncompiled step) run the paged kernels of
  `config.kernel_backend` over exactly the cached tokens, so an eager static cache computes what `KDSACache` does.

Paging (growth, sharing, copy-on-write), rollback (`crop`) and beam reordering are what `KDSACache` is for; this
cache refuses `crop` and `reorder_cache` with a ValueError.
"""

import torch
from transformers.cache_utils import Cache, StaticCache

from .cache import (
    PAGE_SIZE,
    KDAReplayLayer,
    KDSACacheMixin,
    KDSAPagedKPoolLayer,
    KDSAPagedLayer,
    KDSAPagedMLALayer,
    PageView,
    _bytes_view,
    attention_store_class,
    map_planes,
    slid_conv_window,
)
from .configuration_kdsa import DSA_LAYER, MLA_LAYER
from .dsa_paged_static import static_kpool_origin
from .kernels import kernel_set
from .numeric_formats import stored_planes


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _mark_static(tensor: torch.Tensor) -> None:
    """Fixed address for CUDA graphs (`mode="reduce-overhead"`); only outside a compiled region, as transformers'
    StaticLayer does."""
    if not _compiling():
        torch._dynamo.mark_static_address(tensor)


# ----------------------------------------------------------------------------------------------------------------
# Layers


def append_conv_window(conv_state: torch.Tensor, columns: torch.Tensor) -> None:
    """Slide the conv window `[B, C, W]` in place over the new pre-conv columns `[B, C, T]` (fixed address)."""
    conv_state.copy_(slid_conv_window(conv_state, columns))


class StaticKDALayer(KDAReplayLayer):
    """KDA layer state at fixed addresses: allocated by the first (eager) write, then updated with `copy_`.
    No rollback records (`rollback_tokens = 0`): `crop` raises."""

    is_compileable = True
    is_croppable = False

    def __init__(self, conv_kernel_size: int):
        super().__init__(conv_kernel_size, rollback_tokens=0)

    def record(self, *args) -> None:
        """Nothing to record: a static cache never rolls back (and a Python counter would recompile every step)."""

    def _slide_conv_window(self, columns: torch.Tensor) -> torch.Tensor:
        """The window `[B, C, W]`, overwritten in place."""
        if not self.is_conv_states_initialized[0]:
            self.conv_states[0] = columns.new_zeros(*columns.shape[:-1], self.conv_kernel_size[0])
            _mark_static(self.conv_states[0])
            self.is_conv_states_initialized[0] = True
        append_conv_window(self.conv_states[0], columns)
        return self.conv_states[0]

    def _store_recurrent_state(self, state: torch.Tensor) -> torch.Tensor:
        """The fp32 state `[B, H, K, V]`, overwritten in place."""
        if not self.is_recurrent_states_initialized[0]:
            self.recurrent_states[0] = torch.zeros_like(state)
            _mark_static(self.recurrent_states[0])
            self.is_recurrent_states_initialized[0] = True
        return self.recurrent_states[0].copy_(state)

    def crop(self, max_length: int) -> None:
        raise ValueError(_NO_CROP)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError(_NO_REORDER)

    def reset(self) -> None:
        """Zero the states in place (their addresses stay: a compiled step keeps using them)."""
        for states in (self.conv_states, self.recurrent_states):
            if states[0] is not None:
                states[0].zero_()
        self.has_previous_state[0] = False


_NO_CROP = (
    "KDSAStaticCache does not support crop (speculative rollback): use the dynamic KDSACache "
    "(cache_implementation=None) for assisted generation / prompt lookup"
)
_NO_REORDER = (
    "KDSAStaticCache does not support reorder_cache (beam search): use the dynamic KDSACache (cache_implementation="
    "None), whose pages are shared between beams"
)


class _StaticPagedMixin:
    """Fixed-capacity paging for `KDSAPagedMLALayer` and its DSA subclass: `max_cache_len` tokens per sequence in
    `ceil(max_cache_len / P)` pre-mapped pages; `num_tokens` is a 0-d int64 tensor."""

    is_compileable = True
    is_croppable = False
    layout_class: type  # the paged store whose planes it holds (what the attention layer checks)

    def __init__(self, max_cache_len: int, **kwargs):
        self.layout_class.__init__(self, **kwargs)
        self._init_static(max_cache_len)

    @classmethod
    def from_config(cls, config, max_cache_len: int, page_size: int = PAGE_SIZE):
        return cls(max_cache_len, **cls.layout_class.config_kwargs(config, page_size))

    def _init_static(self, max_cache_len: int) -> None:
        if max_cache_len <= 0:
            raise ValueError(f"max_cache_len must be > 0, got {max_cache_len}")
        self.max_cache_len = max_cache_len
        self.pages_per_sequence = -(-max_cache_len // self.page_size)
        self.num_tokens = torch.zeros((), dtype=torch.long)

    @property
    def capacity(self) -> int:
        """Slots per sequence (`max_cache_len` rounded up to whole pages): the key width of the fixed-shape kernels."""
        return self.pages_per_sequence * self.page_size

    def lazy_initialization(self, *rows: torch.Tensor) -> None:
        batch_size = rows[0].shape[0]
        self.dtype, self.device = rows[0].dtype, rows[0].device
        self._bind_layout(kernel_set(self.kernel_backend, self.device))  # first: the kernels choose the layout
        num_pages = batch_size * self.pages_per_sequence
        widths = zip(rows, self.row_widths, strict=True)
        pools = self._encode(*(row.new_zeros(num_pages, self.page_size, width) for row, width in widths))
        for name, store in zip(self.store_names, pools, strict=True):
            # Own contiguous planes (an encoding may return views): the kernels read rows by flat slot id.
            setattr(self, name, map_planes(store, lambda plane: plane.contiguous().clone()))
        # Sequence b owns pages b·n … b·n + n - 1, in order: the fixed-shape reads take the pool in that order, in
        # place (block table None, dsa_paged_common.sequence_rows); the table serves the eager kernels and the writes.
        self.block_table = torch.arange(num_pages, device=self.device).view(batch_size, self.pages_per_sequence)
        self.num_tokens = torch.zeros((), dtype=torch.long, device=self.device)
        for tensor in (*self._all_planes(), self.block_table, self.num_tokens):
            _mark_static(tensor)
        self.page_refcount = [1] * num_pages
        self.is_initialized = True

    def _write(self, *rows: torch.Tensor) -> torch.Tensor:
        """Store rows `[B, T, width]` at positions `num_tokens …` in place; returns the 0-d count before them."""
        batch_size, new_tokens = self._begin_write(rows)
        # No capacity check here (it would read the count on the host in every layer): `KDSAStaticCache.begin_forward`
        # checks once per forward, before any layer writes.
        past = self.num_tokens.clone()
        positions = past + torch.arange(new_tokens, device=self.device)
        slots = self.physical_slots(positions.expand(batch_size, -1)).reshape(-1)
        for store, encoded in zip(self._stores(), self._encode(*rows), strict=True):
            for plane, new in zip(stored_planes(store), stored_planes(encoded), strict=True):
                _bytes_view(plane).flatten(0, 1).index_copy_(0, slots, _bytes_view(new).flatten(0, 1))
        self.num_tokens.add_(new_tokens)
        return past

    def mask_width(self, new_tokens: int) -> int:
        """Width of the 2-D padding mask the layer takes: the capacity (the model pads the mask to it)."""
        return self.capacity

    def key_view(self, query_start, key_padding_mask=None) -> PageView:
        """Compiling: the fixed shapes (no block table: the pool in sequence order; the 0-d count, the
        capacity-padded mask) for the `static_*` kernels. Eager: the paged kernels' arguments over the cached tokens
        only (ints, the mask cut to them), so an eager static cache computes what `KDSACache` does."""
        if _compiling():
            return PageView(None, self.num_tokens, query_start, key_padding_mask, self._view_origin(), fixed_shape=True)
        num_keys = int(self.num_tokens)
        mask = None if key_padding_mask is None else key_padding_mask[:, :num_keys]
        return PageView(self.block_table, num_keys, int(query_start), mask, self._view_origin())

    def selection_view(self) -> PageView:
        """Reads at given positions (a DSA layer's own selection, or the previous layer's for a shared-indexer layer)
        take the block table either way; compiling, with the fixed-shape kernel."""
        return PageView(self.block_table, self.num_tokens, pool_origin=self._view_origin(), fixed_shape=_compiling())

    def get_seq_length(self) -> torch.Tensor:
        return self.num_tokens

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError(_NO_REORDER)

    def crop(self, max_length: int) -> None:
        raise ValueError(_NO_CROP)

    def reset(self) -> None:
        """Forget the tokens; the pool and block table keep their addresses (a compiled step keeps using them)."""
        if self.is_initialized:
            self.num_tokens.zero_()

    def memory_bytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"allocated": 0, "in_use": 0}
        allocated = sum(plane.nbytes for plane in self._all_planes())
        return {"allocated": allocated, "in_use": allocated}


class StaticPagedMLALayer(_StaticPagedMixin, KDSAPagedMLALayer):
    """Fixed-capacity latent store of a dense MLA layer (`"full_attention"`) or a shared-indexer DSA layer."""

    layout_class = KDSAPagedMLALayer


class StaticPagedLayer(_StaticPagedMixin, KDSAPagedLayer):
    """Fixed-capacity latent + indexer-key store of a DSA layer."""

    layout_class = KDSAPagedLayer


class StaticKPoolLayer(_StaticPagedMixin, KDSAPagedKPoolLayer):
    """Fixed-capacity store of a DSA layer with the k-pool indexer (docs/dsa.md §9): the per-token `[key | gate]` rows
    and a pooled-key plane `[pages, P / kp, DI]` with a slot for every possible pool. The pools a write completes are
    pooled and stored with a fixed number of candidates per forward (no data-dependent shape, no host read); the
    pool origin comes from the capacity-padded mask (`static_kpool_origin`) and is kept in `pool_origin`."""

    layout_class = KDSAPagedKPoolLayer

    def lazy_initialization(self, *rows: torch.Tensor) -> None:
        batch_size = rows[0].shape[0]
        num_pages = batch_size * self.pages_per_sequence
        # Before the token planes: the mixin marks every paged plane (pooled keys included) static.
        self.pool_pages = rows[0].new_zeros(num_pages, self.page_size // self.index_kpool, self.index_width)
        self.pool_origin = torch.zeros(batch_size, dtype=torch.long, device=rows[0].device)
        _mark_static(self.pool_origin)
        super().lazy_initialization(*rows)

    def _forward_origin(self, key_padding_mask, batch_size: int, new_tokens: int, device) -> torch.Tensor:
        """The origin from the capacity-padded mask, with no host read; checked eagerly only (a compiled step trusts
        generate's mask)."""
        origin = static_kpool_origin(key_padding_mask, batch_size, device)
        if not _compiling():
            self._check_origin(origin, key_padding_mask, new_tokens)
        return origin

    def _keep_origin(self, origin: torch.Tensor) -> None:
        self.pool_origin.copy_(origin)  # in place: a compiled step keeps the address

    def reset(self) -> None:
        """Forget the tokens (addresses kept); stale pooled keys are never read: a slot is read only once the pool
        ending there is written again."""
        super().reset()
        if self.is_initialized:
            self.pool_origin.zero_()


class KDSAStaticCache(KDSACacheMixin, StaticCache):
    """Fixed-capacity, compileable KDSA cache (docs/graph-mode.md §2): a transformers `StaticCache` whose layers are
    ours (`StaticKDALayer`, `StaticPagedLayer`, `StaticKPoolLayer`, `StaticPagedMLALayer`). `max_cache_len` tokens
    per sequence, a batch fixed by the first forward. `generate(cache_implementation="static")` builds it with capacity
    `max(max_length, generation_config.max_cache_len)`; build it yourself as `KDSAStaticCache(config, max_cache_len)`.

    Refuses `crop` (speculative decoding), `reorder_cache` (beam search) and a 2-D padding mask wider than the
    capacity, each with a ValueError. A forward that would exceed the capacity raises before anything is written
    (checked eagerly; a compiled step trusts generate's sizing).

    `decode_step`: None, or a decode-step package bound to this cache (`modeling_kdsa.aot.load_decode_step` sets it):
    the model's eager forward then runs each one-token step through it (docs/graph-mode.md §14).
    """

    def __init__(self, config, max_cache_len: int, page_size: int = PAGE_SIZE):
        if max_cache_len <= 0:
            raise ValueError(f"max_cache_len must be > 0, got {max_cache_len}")
        layers = []
        for layer_idx, layer_type in enumerate(config.layer_types):
            if layer_type not in (DSA_LAYER, MLA_LAYER):
                layers.append(StaticKDALayer(config.linear_conv_kernel_dim))
            elif attention_store_class(config, layer_idx) is KDSAPagedKPoolLayer:
                layers.append(StaticKPoolLayer.from_config(config, max_cache_len, page_size))
            elif attention_store_class(config, layer_idx) is KDSAPagedLayer:
                layers.append(StaticPagedLayer.from_config(config, max_cache_len, page_size))
            else:  # dense MLA, or a shared-indexer DSA layer: latent rows only
                layers.append(StaticPagedMLALayer.from_config(config, max_cache_len, page_size))
        # `Cache.__init__`, not `StaticCache.__init__`: the latter builds transformers' own layers from the config's
        # layer types (cache_utils.STATIC_LAYER_TYPE_MAPPING); these layers are ours.
        Cache.__init__(self, layers=layers)
        self.max_cache_tokens = max_cache_len
        self.max_cache_len = max_cache_len
        self.page_size = page_size
        self.rollback_tokens = 0
        self.cumulative_length = torch.zeros((), dtype=torch.long)
        _mark_static(self.cumulative_length)
        self.decode_step = None

    @property
    def capacity(self) -> int:
        """Key slots per sequence: `max_cache_len` rounded up to whole pages (the width of the padded mask)."""
        return -(-self.max_cache_len // self.page_size) * self.page_size

    def begin_forward(self, new_tokens: int, device: torch.device | None = None) -> torch.Tensor:
        """Capacity check (eager only) and the token count: returns the 0-d count before the new tokens. `device`:
        where the count lives (the model's; moved once, eagerly, at the first forward)."""
        if not _compiling():
            if device is not None and self.cumulative_length.device != device:
                self.cumulative_length = self.cumulative_length.to(device)
                _mark_static(self.cumulative_length)
            past = int(self.cumulative_length)
            if past + new_tokens > self.max_cache_len:
                raise ValueError(
                    f"KDSAStaticCache capacity exceeded: {past} cached + {new_tokens} new tokens > max_cache_len="
                    f"{self.max_cache_len}; nothing was written, the cache still holds {past} tokens"
                )
        past = self.cumulative_length.clone()
        self.cumulative_length.add_(new_tokens)
        return past

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, max_length: int) -> None:
        raise ValueError(_NO_CROP)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError(_NO_REORDER)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError(_NO_REORDER)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.cumulative_length.zero_()


__all__ = [
    "KDSAStaticCache",
    "StaticKDALayer",
    "StaticKPoolLayer",
    "StaticPagedLayer",
    "StaticPagedMLALayer",
]
