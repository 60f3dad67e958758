"""KDSACache: the generation cache of a KDSA model (docs/design.md §3; docs/dsa.md §4; docs/quantization.md §2).

- KDA layers (`KDAReplayLayer`) keep the short-conv window and the fp32 recurrent state per sequence, plus what an
  exact rollback needs (docs/design.md §5; docs/kda.md §7): a checkpoint (conv
  window + fp32 state) and, for each token since it, the inputs of its recurrence step. `crop` replays the kept
  prefix from the checkpoint with the decode kernel, so the rolled-back state is the one stepping would give.
- DSA layers keep a **paged** store (`KDSAPagedLayer`): fixed-size pages of `page_size` tokens in one pool per
  layer, and a block table per sequence mapping logical pages to physical pages. Each token row holds the
  normalised MLA latent and the RoPE'd key `[c | k_pe]` (`kv_pages`) and the indexer key (`index_pages`). Pages are
  allocated as sequences grow; beams that share a prefix after `reorder_cache` share its pages (reference counts,
  copy-on-write for the page being filled).
- Dense MLA layers (`"full_attention"`, no indexer) keep the same paged latent store without indexer keys
  (`KDSAPagedMLALayer`, the DSA store's base class) and read it with the dense causal MLA kernel (docs/dsa.md §8).
  A shared-indexer DSA layer (`indexer_types`) keeps the same latent-only store and reads it sparsely at the
  selection of the layer before it (docs/dsa.md §10). The k-pool indexer (`index_kpool > 1`) adds a plane of pooled
  keys to the DSA store (`KDSAPagedKPoolLayer`, docs/dsa.md §9). `attention_store_class` picks the store of a layer.
- The store allocates, encodes, counts, crops and replays; it runs no read kernel. The attention layer picks the
  paged DSA kernels (`dsa_paged_*.py`, from the registry's set for `config.kernel_backend`, kernels.py) and calls
  them with the store's planes and its page view (`key_view`, `selection_view`: block table, token count, pool
  origin), docs/dsa.md §14. The one thing the store takes from the registry is its storage layout (`kv_store`), and
  the KDA replay runs the kernels the KDA layer hands over with its records.
- Formats (docs/design.md §4, `numeric_formats.CacheFormats`, chosen from `config.quantization_config` when the cache is
  built): each store holds either model-dtype pages or quantized pages (`QuantizedRows`: FP8 latent tiles + fp32
  scales + the RoPE part unquantized; MXFP8 indexer keys + E8M0 scales). One code path for both: rows are encoded
  on `append`, pages are allocated, copied and counted plane by plane, and the kernels dequantize only the pages /
  rows they read. With MXFP8 indexer keys the queries are MXFP8-rounded too before scoring.

Every sequence of a batch has the same number of cached tokens (generate left-pads); padding is described by the
attention mask the model passes to the kernels.
"""

from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin

from .configuration_kdsa import DSA_LAYER, MLA_LAYER
from .dsa_ops import kpool_keys
from .dsa_paged_common import read_rows
from .kernels import KernelSet, kernel_set
from .numeric_formats import PLANAR_ROWS, CacheFormats, stored_planes

PAGE_SIZE = 64  # tokens per page: the CUDA DSA kernels' block size (docs/dsa.md §4)


class PageView(NamedTuple):
    """What a paged read kernel takes from a store besides its planes (docs/dsa.md §14): `block_table` `[B, pages]`
    (None: a fixed-shape read takes the pool in sequence order, static_cache.py), `num_tokens` cached keys (an int,
    or a 0-d tensor in a compiled static step), `query_start` and `key_padding_mask` as the read takes them,
    `pool_origin` (the k-pool store's, else None) and `fixed_shape`: True when the read must use the registry's
    fixed-shape `static_*` kernels (a static store inside a compiled region)."""

    block_table: torch.Tensor | None
    num_tokens: int | torch.Tensor
    query_start: int | torch.Tensor | None = None
    key_padding_mask: torch.Tensor | None = None
    pool_origin: torch.Tensor | None = None
    fixed_shape: bool = False


def _bytes_view(plane: torch.Tensor) -> torch.Tensor:
    """FP8 planes as uint8 for writes: CPU torch has no `index_put` / `copy_` kernels for some 8-bit float types
    (float8_e8m0fnu); the bytes are the values."""
    return plane.view(torch.uint8) if plane.element_size() == 1 and plane.is_floating_point() else plane


def map_planes(pages, function):
    """`function` applied to every plane of a store (`numeric_formats.stored_planes`: the tensors it is made of), same
    container type back."""
    return pages.map(function) if isinstance(pages, PLANAR_ROWS) else function(pages)


class KDSAPagedMLALayer(CacheLayerMixin):
    """Paged latent store of one dense MLA layer (`"full_attention"`, docs/dsa.md §8); the base of the DSA store.

    kv_pages: `[P, page_size, C + R]` rows `[normalised latent c | k_pe]` — a model-dtype tensor, or `QuantizedRows` of
    that geometry when `formats` quantizes it (module doc); on the `npu` backend `SplitRows` / `PackedKVRows` instead
    (the backend's `kv_store`, `_encode_kv`); block_table: int64 `[B, pages per sequence]` (-1 =
    unused), `num_tokens`: cached tokens per sequence. Physical pages come from a pool that doubles when it runs out;
    `page_refcount[p]` counts the block-table entries pointing at page `p`. `latent_width` (C) is the part of a kv
    row that `kv_cache="fp8"` quantizes; the rest (RoPE slice) stays in the model dtype. Subclasses add planes of
    per-token rows (`store_names`, `row_widths`, `_encode`) that share the pages and block table, and may add paged
    planes written otherwise (`paged_store_names`). Reads: dense causal attention, or sparse attention at given
    positions (a shared-indexer DSA layer, docs/dsa.md §10).
    """

    is_croppable = True  # `crop` truncates the block table: exact
    store_names = ("kv_pages",)
    construction_fields = ("kv_width", "kernel_backend", "page_size", "formats", "latent_width")  # what `reset` keeps
    config_fields: dict[str, str] = {}  # a subclass's own constructor arguments → the config attributes they take

    def __init__(
        self,
        kv_width: int,
        kernel_backend: str,
        page_size: int = PAGE_SIZE,
        formats: CacheFormats | None = None,
        latent_width: int | None = None,
    ):
        super().__init__()
        self.kv_width = kv_width
        self.kernel_backend = kernel_backend
        self.page_size = page_size
        self.formats = CacheFormats() if formats is None else formats
        self.latent_width = kv_width if latent_width is None else latent_width
        if self.formats.kv_cache != "bf16" and self.latent_width % self.formats.kv_cache_tile_size:
            raise ValueError(
                f"kv_cache={self.formats.kv_cache!r} needs the latent width {self.latent_width} to be a multiple of "
                f"kv_cache_tile_size={self.formats.kv_cache_tile_size}"
            )
        self.kv_pages: torch.Tensor | None = None
        self.block_table: torch.Tensor | None = None
        self.page_refcount: list[int] = []
        self.free_pages: list[int] = []
        self.num_tokens = 0
        self.reserved_tokens = 0  # pages already prepared by `reserve` for the next write of this many tokens

    @classmethod
    def config_kwargs(cls, config, page_size: int = PAGE_SIZE) -> dict:
        """The constructor arguments of this store for `config`: the MLA row's, and each subclass's
        `config_fields` (constructor argument → config attribute)."""
        return dict(
            kv_width=config.kv_lora_rank + config.qk_rope_head_dim,
            kernel_backend=config.kernel_backend,
            page_size=page_size,
            formats=CacheFormats.from_config(config),
            latent_width=config.kv_lora_rank,
            **{argument: getattr(config, name) for argument, name in cls.config_fields.items()},
        )

    @classmethod
    def from_config(cls, config, page_size: int = PAGE_SIZE) -> "KDSAPagedMLALayer":
        """The store of a layer of `config`, in the formats `config.quantization_config` asks for."""
        return cls(**cls.config_kwargs(config, page_size))

    # ---------------------------------------------------------------------------------------------- bookkeeping
    @property
    def row_widths(self) -> tuple[int, ...]:
        """Width of one token's row in each of `store_names`."""
        return (self.kv_width,)

    @property
    def paged_store_names(self) -> tuple[str, ...]:
        """Every store laid out by page (allocated, copied on write and counted together): the per-token
        `store_names`, plus planes a subclass writes otherwise."""
        return self.store_names

    def _stores(self) -> tuple:
        return tuple(getattr(self, name) for name in self.store_names)

    def _all_planes(self) -> tuple[torch.Tensor, ...]:
        return tuple(plane for name in self.paged_store_names for plane in stored_planes(getattr(self, name)))

    def _encode(self, kv_rows: torch.Tensor) -> tuple:
        """Rows `[..., C + R]` in the stored format (a tensor or `QuantizedRows`), one entry per store."""
        return (self._encode_kv(kv_rows),)

    def _encode_kv(self, kv_rows: torch.Tensor):
        """Latent rows in the layout of the backend's attention kernels (its `kv_store`): one plane per part, or on
        the `npu` backend the layouts torch_npu's ops read in place (`SplitRows`, `PackedKVRows`; docs/backends.md
        §2)."""
        return self.kv_store(self.formats, kv_rows.to(self.dtype), self.latent_width)

    def _bind_layout(self, kernels: KernelSet) -> None:
        """The storage layout the backend's read kernels expect (its `kv_store` encoder). The store keeps this one
        entry of the registry's set and no kernel: the layer picks and runs those (docs/dsa.md §14)."""
        self.kv_store = kernels.require("kv_store")

    def lazy_initialization(self, *rows: torch.Tensor) -> None:
        batch_size = rows[0].shape[0]
        self.dtype, self.device = rows[0].dtype, rows[0].device
        self._bind_layout(kernel_set(self.kernel_backend, self.device))  # first: the kernels choose the layout
        # Empty pools in the stored formats: encoding zero rows gives every plane its dtype and width.
        widths = zip(rows, self.row_widths, strict=True)
        empty = self._encode(*(row.new_zeros(0, self.page_size, width) for row, width in widths))
        for name, store in zip(self.store_names, empty, strict=True):
            setattr(self, name, store)
        self.block_table = torch.full((batch_size, 0), -1, dtype=torch.long, device=self.device)
        self.is_initialized = True

    @property
    def batch_size(self) -> int:
        return 0 if self.block_table is None else self.block_table.shape[0]

    def _grow_pool(self, min_free: int) -> None:
        """Make at least `min_free` pages free, doubling the pool (amortised O(1) per page)."""
        missing = min_free - len(self.free_pages)
        if missing <= 0:
            return
        old = len(self.page_refcount)
        new = max(2 * old, old + missing, 4)

        def grown(plane: torch.Tensor) -> torch.Tensor:
            larger = plane.new_zeros(new, *plane.shape[1:])
            _bytes_view(larger)[:old] = _bytes_view(plane)
            return larger

        for name in self.paged_store_names:
            setattr(self, name, map_planes(getattr(self, name), grown))
        self.page_refcount.extend([0] * (new - old))
        self.free_pages.extend(range(new - 1, old - 1, -1))  # pop() hands out low page ids first

    def _take_page(self) -> int:
        page = self.free_pages.pop()
        self.page_refcount[page] = 1
        return page

    def _release(self, page: int) -> None:
        self.page_refcount[page] -= 1
        if self.page_refcount[page] == 0:
            self.free_pages.append(page)

    def _prepare_pages(self, new_tokens: int) -> None:
        """Give every sequence private, allocated pages for positions `num_tokens .. num_tokens + new_tokens - 1`:
        allocate missing pages and copy a shared partially-filled page before it is written (copy-on-write).
        Full pages of a shared prefix stay shared: they are never written again."""
        first_page = self.num_tokens // self.page_size
        last_page = (self.num_tokens + new_tokens - 1) // self.page_size
        table = self.block_table
        shared_partial = self.num_tokens % self.page_size != 0
        if last_page >= table.shape[1]:
            pad = torch.full(
                (table.shape[0], last_page + 1 - table.shape[1]), -1, dtype=torch.long, device=table.device
            )
            table = torch.cat([table, pad], dim=1)
        # Count from the pages written only: most decode steps write into private pages every sequence already owns,
        # and then the table is not rebuilt (an O(pages) trip through Python lists).
        written = table[:, first_page : last_page + 1].tolist()
        copies = [shared_partial and self.page_refcount[row[0]] > 1 for row in written]
        needed = sum(page < 0 for row in written for page in row) + sum(copies)
        if needed == 0:
            return
        self._grow_pool(needed)
        rows = table.tolist()
        for row, copy_on_write in zip(rows, copies, strict=True):
            if copy_on_write:
                shared, private = row[first_page], self._take_page()
                for plane in self._all_planes():
                    _bytes_view(plane)[private] = _bytes_view(plane)[shared]
                self._release(shared)
                row[first_page] = private
            for p in range(first_page, last_page + 1):
                if row[p] < 0:
                    row[p] = self._take_page()
        self.block_table = torch.tensor(rows, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------------------------------------- writes
    def _begin_write(self, rows: tuple[torch.Tensor, ...]) -> tuple[int, int]:
        """Check a write's rows `[B, T, width]` against the store, allocating it on the first write; returns (B, T)."""
        if tuple(row.shape[-1] for row in rows) != self.row_widths:
            raise ValueError(
                f"paged {type(self).__name__} expects rows of widths {self.row_widths} "
                f"({', '.join(self.store_names)}), got shapes {[tuple(row.shape) for row in rows]}"
            )
        if not self.is_initialized:
            self.lazy_initialization(*rows)
        batch_size, new_tokens, _ = rows[0].shape
        if batch_size != self.batch_size:
            raise ValueError(f"cache holds {self.batch_size} sequences, got a batch of {batch_size}")
        return batch_size, new_tokens

    def _write(self, *rows: torch.Tensor) -> int:
        """Store the current tokens' rows `[B, T, width]`, one tensor per store. Returns the tokens cached before."""
        batch_size, new_tokens = self._begin_write(rows)
        past = self.num_tokens
        if new_tokens == 0:
            return past
        if self.reserved_tokens != new_tokens:
            self._prepare_pages(new_tokens)
        self.reserved_tokens = 0
        slots = self.physical_slots(torch.arange(past, past + new_tokens, device=self.device).expand(batch_size, -1))
        slots = slots.reshape(-1)
        for store, encoded in zip(self._stores(), self._encode(*rows), strict=True):
            for plane, new in zip(stored_planes(store), stored_planes(encoded), strict=True):
                _bytes_view(plane).flatten(0, 1)[slots] = _bytes_view(new).flatten(0, 1)
        self.num_tokens = past + new_tokens
        return past

    def reserve(self, new_tokens: int, like: torch.Tensor) -> None:
        """Prepare the pages of the next write of `new_tokens` tokens now (allocating the pools first, in `like`'s
        batch size, dtype and device, if this is the first write). The model calls it before its layers run, so that
        the host-side page allocator (a graph break under `torch.compile`) never runs inside a decoder layer
        (docs/graph-mode.md §1)."""
        if new_tokens == 0:
            return
        if not self.is_initialized:
            self.lazy_initialization(*(like.new_zeros(like.shape[0], 0, width) for width in self.row_widths))
        self._prepare_pages(new_tokens)
        self.reserved_tokens = new_tokens

    def append(self, kv_rows: torch.Tensor) -> int:
        """Store the current tokens' rows `[B, T, C + R]`. Returns the number of tokens cached before them."""
        return self._write(kv_rows)

    def mask_width(self, new_tokens: int) -> int:
        """Width of the 2-D padding mask a forward of `new_tokens` tokens passes: past + new tokens (a fixed-capacity
        store takes its capacity instead, static_cache.py)."""
        return self.num_tokens + new_tokens

    def physical_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Logical token positions `[B, N]` → row indices into `kv_pages.view(-1, width)`."""
        pages = self.block_table.gather(1, positions // self.page_size)
        return pages * self.page_size + positions % self.page_size

    # ----------------------------------------------------------------------------------------------- page views
    def _view_origin(self) -> torch.Tensor | None:
        """The k-pool store's `pool_origin` (`KDSAPagedKPoolLayer`); other stores have none (and no attribute:
        aot/decode_step.py lists a store's tensors by the attributes it has)."""
        return getattr(self, "pool_origin", None)

    def key_view(self, query_start: int, key_padding_mask: torch.Tensor | None = None) -> PageView:
        """The view of a read over every cached key (dense attention, indexer top-k) for queries at
        `query_start + i`; the layer runs the kernel (dsa.py, docs/dsa.md §14)."""
        return PageView(self.block_table, self.num_tokens, query_start, key_padding_mask, self._view_origin())

    def selection_view(self) -> PageView:
        """The view of a read at selected positions (sparse attention over indices `[B, T, K]`, -1 = none)."""
        return PageView(self.block_table, self.num_tokens, pool_origin=self._view_origin())

    # -------------------------------------------------------------------------- transformers CacheLayerMixin API
    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is written through `append` by the KDSA attention layer")

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_tokens + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Sequence i takes over the pages of sequence `beam_idx[i]`; shared pages are reference-counted."""
        if not self.is_initialized:
            return
        old_rows = self.block_table.tolist()
        new_table = self.block_table.index_select(0, beam_idx.to(self.device))
        for page in new_table[new_table >= 0].tolist():
            self.page_refcount[page] += 1
        for row in old_rows:
            for page in row:
                if page >= 0:
                    self._release(page)
        self.block_table = new_table

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens (negative: drop `-max_length` tokens). Pages past the end are
        released; the partly kept page stays and is overwritten (or copied, if shared) by the next append."""
        new_length = max_length if max_length >= 0 else self.num_tokens + max_length
        if not 0 <= new_length <= self.num_tokens:
            raise ValueError(f"cannot crop a paged layer holding {self.num_tokens} tokens to {new_length} tokens")
        if not self.is_initialized or new_length == self.num_tokens:
            return
        keep_pages = -(-new_length // self.page_size)
        for page in self.block_table[:, keep_pages:].reshape(-1).tolist():
            if page >= 0:
                self._release(page)
        self.block_table = self.block_table[:, :keep_pages].clone()
        self.num_tokens = new_length

    def reset(self) -> None:
        """Forget every page: the store as constructed (from its `construction_fields`)."""
        self.__init__(**{name: getattr(self, name) for name in self.construction_fields})

    def bytes_per_page(self) -> int:
        """Bytes one page takes in every plane (values, scales, RoPE part, pooled keys)."""
        return sum(plane.shape[1:].numel() * plane.element_size() for plane in self._all_planes())

    def bytes_per_token(self) -> int:
        """Bytes one cached token takes in this store: its row in every per-token plane (values, scales, RoPE part)
        and its share of a page-level plane (a pooled key: `DI / kp` values per token)."""
        return self.bytes_per_page() // self.page_size

    def memory_bytes(self) -> dict[str, int]:
        """`allocated`: the page pool; `in_use`: pages some sequence points at (shared pages counted once)."""
        if not self.is_initialized:
            return {"allocated": 0, "in_use": 0}
        in_use = sum(1 for count in self.page_refcount if count > 0)
        allocated = sum(plane.nbytes for plane in self._all_planes())
        return {"allocated": allocated, "in_use": in_use * self.bytes_per_page()}


class KDSAPagedLayer(KDSAPagedMLALayer):
    """Paged latent + indexer-key store of one DSA layer: `KDSAPagedMLALayer`'s `kv_pages` plus `index_pages`
    `[P, page_size, DI]` (model dtype, or MXFP8 `QuantizedRows` when `formats` asks for it), one row per token in the
    same pages."""

    store_names = ("kv_pages", "index_pages")
    construction_fields = (*KDSAPagedMLALayer.construction_fields, "index_width")
    config_fields = {"index_width": "index_head_dim"}

    def __init__(
        self,
        kv_width: int,
        index_width: int,
        kernel_backend: str,
        page_size: int = PAGE_SIZE,
        formats: CacheFormats | None = None,
        latent_width: int | None = None,
    ):
        super().__init__(kv_width, kernel_backend, page_size, formats, latent_width)
        self.index_width = index_width
        self.index_pages: torch.Tensor | None = None

    @property
    def row_widths(self) -> tuple[int, ...]:
        return (self.kv_width, self.index_width)

    def _encode(self, kv_rows: torch.Tensor, index_keys: torch.Tensor) -> tuple:
        """Rows `[..., C + R]` and keys `[..., DI]` in the stored formats (tensors or `QuantizedRows`)."""
        return self._encode_kv(kv_rows), self.formats.encode_index_keys(index_keys.to(self.dtype))

    def append(self, kv_rows: torch.Tensor, index_keys: torch.Tensor) -> int:
        """Store the current tokens: kv_rows `[B, T, C + R]`, index_keys `[B, T, DI]`. Returns the number of tokens
        cached before them (the position of the first new token)."""
        return self._write(kv_rows, index_keys)

    def encode_index_queries(self, q_index: torch.Tensor) -> torch.Tensor:
        """Indexer queries `[B, T, HI, DI]` in the format the stored keys are scored in: with MXFP8 keys they are
        MXFP8-rounded (dynamic, per block of 32), else returned as they are."""
        return self.formats.quantize_index_queries(q_index)


class KDSAPagedKPoolLayer(KDSAPagedLayer):
    """Paged store of a DSA layer with the k-pool indexer (`index_kpool = kp > 1`, docs/dsa.md §9).

    `index_pages` rows are `[normalised key | gate score]` `[2·DI]` per token (a pool cut by a crop is pooled again
    from them); `pool_pages` `[P, page_size // kp, DI]` holds the pooled key of every complete pool in the page of
    its last token (slot `(end % page_size) // kp`), written by `append` when that token arrives, so paging,
    copy-on-write, reordering and crop treat it like the per-token planes. Pools start at each sequence's first real
    token (`pool_origin`, from the left-padding mask). A pool is read only once its last token is cached.
    """

    construction_fields = (*KDSAPagedLayer.construction_fields, "index_kpool")
    config_fields = {**KDSAPagedLayer.config_fields, "index_kpool": "index_kpool"}

    def __init__(self, *args, index_kpool: int = 2, **kwargs):
        """`KDSAPagedLayer`'s arguments, and the tokens per pool."""
        super().__init__(*args, **kwargs)
        if index_kpool < 2 or self.page_size % index_kpool:
            raise ValueError(
                f"index_kpool={index_kpool} must be >= 2 and divide the page size {self.page_size}: a page holds whole "
                "pooled-key slots"
            )
        if self.formats.indexer != "bf16":
            raise ValueError(
                f"indexer={self.formats.indexer!r} cache format is not implemented for the k-pool indexer "
                f"(index_kpool={index_kpool}): its pooled keys are stored in the model dtype"
            )
        self.index_kpool = index_kpool
        self.pool_pages: torch.Tensor | None = None
        self.pool_origin: torch.Tensor | None = None

    @property
    def row_widths(self) -> tuple[int, ...]:
        return (self.kv_width, 2 * self.index_width)

    @property
    def paged_store_names(self) -> tuple[str, ...]:
        return (*self.store_names, "pool_pages")

    def lazy_initialization(self, *rows: torch.Tensor) -> None:
        super().lazy_initialization(*rows)
        self.pool_pages = rows[0].new_zeros(0, self.page_size // self.index_kpool, self.index_width, dtype=self.dtype)

    def append(
        self,
        kv_rows: torch.Tensor,
        index_rows: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        kpool_ape: torch.Tensor,
    ) -> int:
        """Store the current tokens: kv_rows `[B, T, C + R]`, index_rows `[B, T, 2·DI]` (key, gate scores), and pool
        every pool they complete with the position bias `kpool_ape` `[kp, DI]`. `key_padding_mask` `[B, past + T]`
        (left padding, or None) places the pools. Returns the number of tokens cached before them."""
        if kpool_ape is None or tuple(kpool_ape.shape) != (self.index_kpool, self.index_width):
            raise ValueError(f"the k-pool store needs kpool_ape [{self.index_kpool}, {self.index_width}]")
        batch_size, new_tokens, _ = kv_rows.shape
        origin = self._forward_origin(key_padding_mask, batch_size, new_tokens, kv_rows.device)
        past = self._write(kv_rows, index_rows)
        if new_tokens:
            self._keep_origin(origin)
            self._write_pools(past, new_tokens, origin, kpool_ape)
        return past

    def _forward_origin(self, key_padding_mask, batch_size: int, new_tokens: int, device) -> torch.Tensor:
        """The pool origin of this forward (each sequence's first real token, int64 `[B]`), checked (`_check_origin`)
        before anything is written."""
        num_keys = self.num_tokens + new_tokens
        if key_padding_mask is None:
            origin = torch.zeros(batch_size, dtype=torch.long, device=device)
        else:
            origin = num_keys - key_padding_mask[:, :num_keys].bool().sum(dim=-1)  # kpool_origin, for left padding
        self._check_origin(origin, key_padding_mask, new_tokens)
        return origin

    def _keep_origin(self, origin: torch.Tensor) -> None:
        self.pool_origin = origin

    def _check_origin(self, origin: torch.Tensor, key_padding_mask, new_tokens: int) -> None:
        """One host read: over the context the mask is left padding from `origin`, and the origin of the pools already
        stored is kept (a mask that moves it would make them wrong). Skipped while compiling, as the other host-side
        value checks (docs/graph-mode.md §1): a graph break inside a layer would split the residual stream."""
        if torch.compiler.is_compiling():
            return
        past = self.num_tokens
        failures = torch.zeros(2, dtype=torch.bool, device=origin.device)
        if key_padding_mask is not None:
            slots = torch.arange(key_padding_mask.shape[1], device=origin.device)
            left_padding = slots >= origin[:, None]
            failures[0] = ((key_padding_mask.bool() != left_padding) & (slots < past + new_tokens)).any()
        if self.pool_origin is not None:
            failures[1] = ((origin != self.pool_origin) & (self.pool_origin < past)).any()
        not_left_padding, moved = failures.tolist()
        if not_left_padding:
            raise ValueError(
                "attention_mask must be left padding (zeros, then ones) for the k-pool indexer (index_kpool > 1): its "
                "pools start at each sequence's first real token"
            )
        if moved:
            raise ValueError(
                "attention_mask changed where a sequence's first real token is after its k-pools were stored; "
                "pass the same left padding on every forward"
            )

    def _write_pools(self, past, new_tokens: int, origin: torch.Tensor, ape: torch.Tensor) -> None:
        """Pool and store the pools completed by positions `past … past + new_tokens - 1` (docs/dsa.md §9); `past`
        an int, or a 0-d tensor in a static cache. No host read and no data-dependent shape.

        They end at `origin + kp - 1 + k·kp` for `k >= k0` (the first end at or after `past`): at most
        `ceil(new_tokens / kp)` of them, so that many candidates per sequence, each pooled from its `kp` token rows and
        written to its slot; a candidate past the new tokens writes its slot's current value back. Consecutive
        candidates name consecutive groups of `kp` tokens, so, taken modulo the groups the block table maps, their
        slots are distinct and no write collides; a wrapped candidate's slot may be a shared page's, which gets its
        own value back."""
        kpool, width = self.index_kpool, self.index_width
        slots_per_page = self.page_size // kpool
        batch_size = origin.shape[0]
        first_end = origin + kpool - 1
        first_k = (past - first_end + kpool - 1).div(kpool, rounding_mode="floor").clamp(min=0)
        candidates = torch.arange(-(-new_tokens // kpool), device=self.device)
        ends = first_end[:, None] + kpool * (first_k[:, None] + candidates)  # [B, J]
        completed = ends < past + new_tokens
        num_groups = self.block_table.shape[1] * slots_per_page
        groups = (ends // kpool) % num_groups
        pool_slots = self.block_table.gather(1, groups // slots_per_page) * slots_per_page + groups % slots_per_page
        pool_slots = pool_slots.reshape(-1)
        tokens = (ends[..., None] + torch.arange(1 - kpool, 1, device=self.device)).clamp(0, num_groups * kpool - 1)
        rows = read_rows(self.index_pages, self.physical_slots(tokens.flatten(1)).reshape(-1), self.dtype)
        rows = rows.view(batch_size, -1, kpool, 2 * width)
        pooled = kpool_keys(rows[..., :width], rows[..., width:], ape).to(self.dtype)  # [B, J, DI]
        plane = self.pool_pages.view(-1, width)
        current = plane.index_select(0, pool_slots).view_as(pooled)
        plane.index_copy_(0, pool_slots, torch.where(completed[..., None], pooled, current).flatten(0, 1))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.pool_origin is not None:
            self.pool_origin = self.pool_origin.index_select(0, beam_idx.to(self.device))


def attention_store_class(config, layer_idx: int) -> type[KDSAPagedMLALayer]:
    """The paged store of MLA / DSA layer `layer_idx`: latent rows only for a dense MLA layer (docs/dsa.md §8) and
    a shared-indexer DSA layer (§10), plus indexer keys for a DSA layer, plus pooled keys with the k-pool indexer
    (§9)."""
    if config.layer_types[layer_idx] == MLA_LAYER or config.indexer_types[layer_idx] == "shared":
        return KDSAPagedMLALayer
    return KDSAPagedKPoolLayer if config.index_kpool > 1 else KDSAPagedLayer


# Default rollback window of a KDA layer (tokens since the checkpoint whose replay inputs are kept). transformers
# drafts at most `prompt_lookup_num_tokens` (10) or `num_assistant_tokens` (20, +2 per fully accepted round) tokens
# per round and crops after every round, so 256 is never reached by a draft in practice.
ROLLBACK_TOKENS = 256


def slid_conv_window(conv: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The conv window `[B, C, W]` slid over the new pre-conv columns `[B, C, T]`: the last W columns of both. Only
    the last W new columns are copied (a prefill's `columns` is a strided view of the whole sequence)."""
    width = conv.shape[-1]
    return torch.cat([conv, columns[..., -width:].to(conv.dtype)], dim=-1)[..., -width:]


class KDAReplayRecord(NamedTuple):
    """What one forward fed into a KDA layer's conv and recurrence, per token, so those steps can be replayed.

    conv_inputs: the pre-conv q|k|v columns `[B, C, T]` (model dtype) — they rebuild the conv window;
    k: L2-normalised keys `[B, T, H, K]` fp32; v: `[B, T, H, V]` (model dtype; the kernel upcasts it exactly);
    g: log decay `[B, T, H, K]` fp32; beta: `[B, T, H]` fp32 — exactly the recurrence inputs the layer used.
    """

    conv_inputs: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def tokens(self, start: int, stop: int | None = None) -> "KDAReplayRecord":
        """Own copies of tokens `start:stop` (copies, so a record never pins the forward's larger tensors)."""
        conv_inputs = self.conv_inputs[..., start:stop].clone()
        return KDAReplayRecord(conv_inputs, *(x[:, start:stop].clone() for x in self[1:]))

    def index_select(self, batch_idx: torch.Tensor) -> "KDAReplayRecord":
        return KDAReplayRecord(*(x.index_select(0, batch_idx.to(x.device)) for x in self))

    @staticmethod
    def concat(records: list["KDAReplayRecord"]) -> "KDAReplayRecord":
        conv_inputs = torch.cat([r.conv_inputs for r in records], dim=-1)
        per_token = (torch.cat([getattr(r, name) for r in records], dim=1) for name in ("k", "v", "g", "beta"))
        return KDAReplayRecord(conv_inputs, *per_token)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self)


class KDAReplayLayer(LinearAttentionCacheLayerMixin):
    """Cache of one KDA layer with exact rollback (ReplaySSM style: docs/kda.md §7).

    Live state: `conv_states[0]` — the last W pre-conv q|k|v columns `[B, C, W]` (W = conv kernel width) — and
    `recurrent_states[0]`, the fp32 state `[B, H, K, V]`, after `num_tokens` tokens.

    Rollback: a checkpoint (conv window, fp32 state) after `checkpoint_tokens` tokens, and one `KDAReplayRecord`
    run per forward since then — memory per pending token, never a state copy per token. `crop(n)` for any n in
    `[checkpoint_tokens, num_tokens]` replays the first `n - checkpoint_tokens` recorded steps from the checkpoint
    with the decode kernel itself (`kda_recurrent` of the KernelSet the KDA layer hands over with its records, the
    one it decodes with), so the rebuilt state is bit for bit what stepping those recorded inputs gives; the conv
    window is the last W of the checkpoint window followed by the recorded columns.

    When the checkpoint advances (it only ever moves to a state that is already exact):
    - every `crop` commits: the rolled-back (or, for `crop` to the current length, the live) state becomes the
      checkpoint and the records are dropped — transformers crops after each verification, so the accepted tokens
      are committed and only the next draft is recorded;
    - a forward that would leave more than `rollback_tokens` tokens pending first commits the live state (the
      state before that forward); if the forward alone brings more than `rollback_tokens` tokens (a long prefill),
      its first `T - rollback_tokens` steps are folded into the checkpoint with `kda_chunk` and only the last
      `rollback_tokens` are recorded.
    So at most `rollback_tokens` tokens are ever pending; `crop` before the checkpoint raises and changes nothing.
    `rollback_tokens = 0` keeps no records: no rollback, no overhead (what plain `generate()` uses).
    """

    def __init__(self, conv_kernel_size: int, rollback_tokens: int):
        super().__init__()
        if rollback_tokens < 0:
            raise ValueError(f"rollback_tokens must be >= 0, got {rollback_tokens}")
        self.conv_kernel_size[0] = conv_kernel_size
        self.rollback_tokens = rollback_tokens
        # The KernelSet the KDA layer ran the recorded tokens with (`record`); `crop` replays with it. None while
        # nothing is recorded.
        self.replay_kernels: KernelSet | None = None
        self.num_tokens = 0
        self.checkpoint_tokens = 0
        # (conv window, fp32 state) after `checkpoint_tokens` tokens; None while no record is kept, because then the
        # checkpoint is the live state itself.
        self.checkpoint: tuple[torch.Tensor, torch.Tensor] | None = None
        self.records: list[KDAReplayRecord] = []

    @property
    def pending_tokens(self) -> int:
        return self.num_tokens - self.checkpoint_tokens

    @property
    def is_croppable(self) -> bool:
        return self.rollback_tokens > 0

    # --------------------------------------------------------------------------------------------- live state
    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        reference = conv_states if conv_states is not None else recurrent_states
        if self.device is None and reference is not None:
            self.dtype, self.device = reference.dtype, reference.device
        if conv_states is not None:
            self.is_conv_states_initialized[state_idx] = True
        if recurrent_states is not None:
            self.is_recurrent_states_initialized[state_idx] = True

    def _live_or_zeros(self, conv_inputs: torch.Tensor, state_shape: tuple[int, ...]):
        """The live (conv window, state), or the zeros a sequence starts from (what the kernels assume for None)."""
        if self.has_previous_state[0]:
            return self.conv_states[0], self.recurrent_states[0]
        batch_size, channels, _ = conv_inputs.shape
        conv = conv_inputs.new_zeros(batch_size, channels, self.conv_kernel_size[0])
        return conv, torch.zeros(state_shape, dtype=torch.float32, device=conv_inputs.device)

    def _window(self, conv: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """`slid_conv_window`, contiguous: no view pins the longer tensor."""
        return slid_conv_window(conv, columns).contiguous()

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Append the pre-conv columns `[B, C, T]` of the current tokens to the conv window."""
        if state_idx != 0:
            raise ValueError(f"a KDA layer has one conv state, got state_idx={state_idx}")
        self.conv_states[0] = self._slide_conv_window(conv_states)
        self.has_previous_state[0] = True
        return self.conv_states[0]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Take the kernel's final fp32 state `[B, H, K, V]`."""
        if state_idx != 0:
            raise ValueError(f"a KDA layer has one recurrent state, got state_idx={state_idx}")
        self.recurrent_states[0] = self._store_recurrent_state(recurrent_states)
        return self.recurrent_states[0]

    def _slide_conv_window(self, columns: torch.Tensor) -> torch.Tensor:
        """The window after `columns`. It is a new tensor, never written in place, so a checkpoint can hold the
        previous one without copying it (a static layer overrides this to keep one address)."""
        if not self.is_conv_states_initialized[0]:
            self.lazy_initialization(conv_states=columns)
        previous = columns.new_zeros(*columns.shape[:-1], self.conv_kernel_size[0])
        if self.has_previous_state[0]:
            previous = self.conv_states[0]
        return self._window(previous, columns)

    def _store_recurrent_state(self, state: torch.Tensor) -> torch.Tensor:
        """The live state after `state`: the kernel's tensor itself (replaced, as the conv window is)."""
        if not self.is_recurrent_states_initialized[0]:
            self.lazy_initialization(recurrent_states=state)
        return state

    # ----------------------------------------------------------------------------------------------- rollback
    def record(self, inputs: KDAReplayRecord, kernels: KernelSet) -> None:
        """Called by the KDA layer for every forward, after its kernels ran and before the live state is updated
        (so the live state is still the one before these tokens). `kernels`: the layer's KernelSet, whose
        `kda_chunk` folds a long forward here and whose `kda_recurrent` a later `crop` replays with."""
        k, v = inputs.k, inputs.v
        new_tokens = k.shape[1]
        if self.pending_tokens + new_tokens > self.rollback_tokens:
            self._commit()  # the live state, before these tokens, becomes the checkpoint
        kept = min(new_tokens, self.rollback_tokens)
        if kept == 0:  # nothing to keep: the checkpoint follows the live state
            self.num_tokens += new_tokens
            self.checkpoint_tokens = self.num_tokens
            return
        folded = new_tokens - kept
        if not self.records:
            conv, state = self._live_or_zeros(inputs.conv_inputs, (k.shape[0], k.shape[2], k.shape[3], v.shape[3]))
            if folded:
                # A forward longer than the window: its first steps can never be rolled back to, so fold them into
                # the checkpoint in one pass of the chunked (prefill) kernel; q is unused, k stands in for it.
                fold = inputs.tokens(0, folded)
                kda_chunk = kernels.require("kda_chunk")
                _, state = kda_chunk(
                    fold.k, fold.k, fold.v, fold.g, fold.beta, initial_state=state, output_final_state=True
                )
                conv = self._window(conv, fold.conv_inputs)
            self.checkpoint = (conv, state)
            self.checkpoint_tokens = self.num_tokens + folded
        self.records.append(inputs.tokens(folded))
        self.replay_kernels = kernels
        self.num_tokens += new_tokens

    def commit_unrecorded(self, new_tokens: int) -> None:
        """`new_tokens` were written into the live state without replay inputs (context-parallel prefill): they can
        never be rolled back, so the live state after them becomes the checkpoint."""
        self.num_tokens += new_tokens
        self._commit()

    def _commit(self) -> None:
        """The live state becomes the checkpoint (it is exact already): drop the records."""
        self.records.clear()
        self.replay_kernels = None
        self.checkpoint = None
        self.checkpoint_tokens = self.num_tokens

    def check_crop(self, new_length: int) -> None:
        """Raise, changing nothing, unless `crop` to `new_length` tokens is possible."""
        if not 0 <= new_length <= self.num_tokens:
            raise ValueError(f"cannot crop a KDA layer holding {self.num_tokens} tokens to {new_length} tokens")
        if new_length < self.checkpoint_tokens:
            raise ValueError(
                f"cannot crop to {new_length} tokens: the KDA rollback checkpoint is at {self.checkpoint_tokens} "
                f"tokens (replay inputs are kept since the last crop, for at most rollback_tokens="
                f"{self.rollback_tokens} tokens); the cache is unchanged"
            )

    def crop(self, max_length: int) -> None:
        """Roll back to the first `max_length` tokens (negative: drop `-max_length` tokens) and commit them."""
        new_length = max_length if max_length >= 0 else self.num_tokens + max_length
        self.check_crop(new_length)
        replayed = new_length - self.checkpoint_tokens
        if new_length < self.num_tokens:
            conv, state = self.checkpoint
            if replayed:
                steps = KDAReplayRecord.concat(self.records)
                kernels = self.replay_kernels
                kda_recurrent = kernels.require("kda_recurrent")
                kept = steps.tokens(0, replayed)
                if kernels.kda_recurrent_stepwise(kept.k, kept.v):
                    # The kernel steps every token of a call as a one-token call does (the CPU kernel: the state goes
                    # through the same fp32 buffer): one call over the kept tokens is bit for bit the stepped state.
                    _, state = kda_recurrent(
                        kept.k, kept.k, kept.v, kept.g, kept.beta, initial_state=state, output_final_state=True
                    )
                else:
                    # Replay = the decode kernel itself, called once per token with decode's [B, 1, ...] shapes, so
                    # the rebuilt state is bit for bit the stepped one (one T-token call of the torch reference can
                    # round differently: its strided per-token slices take other matmul kernels). Its output (q = k)
                    # is discarded.
                    for t in range(replayed):
                        step = steps.tokens(t, t + 1)
                        _, state = kda_recurrent(
                            step.k, step.k, step.v, step.g, step.beta, initial_state=state, output_final_state=True
                        )
                conv = self._window(conv, steps.conv_inputs[..., :replayed])
            self.conv_states[0], self.recurrent_states[0] = conv, state
            self.num_tokens = new_length
        self._commit()

    # ------------------------------------------------------------------------------------------ housekeeping
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.has_previous_state[0]:
            return
        beam_idx = beam_idx.to(self.device)
        self.conv_states[0] = self.conv_states[0].index_select(0, beam_idx)
        self.recurrent_states[0] = self.recurrent_states[0].index_select(0, beam_idx)
        if self.checkpoint is not None:
            self.checkpoint = tuple(x.index_select(0, beam_idx) for x in self.checkpoint)
        self.records = [record.index_select(beam_idx) for record in self.records]

    def reset(self) -> None:
        """Zero the live buffers (as transformers does) and forget the tokens, checkpoint and records."""
        super().reset()
        self.num_tokens = 0
        self._commit()

    def memory_bytes(self) -> dict[str, int]:
        """`states`: live conv window + fp32 state; `rollback`: checkpoint + records; `per_pending_token`: bytes one
        pending token's record takes per sequence (0 while nothing is recorded)."""
        states = sum(x.nbytes for x in (self.conv_states[0], self.recurrent_states[0]) if x is not None)
        records = sum(record.nbytes for record in self.records)
        checkpoint = sum(x.nbytes for x in self.checkpoint) if self.checkpoint is not None else 0
        per_token = 0
        if self.records:
            per_token = records // (self.records[0].k.shape[0] * self.pending_tokens)
        return {"states": states, "rollback": checkpoint + records, "per_pending_token": per_token}


class KDSACacheMixin:
    """What the two KDSA caches share: the growing `KDSACache` (a transformers `DynamicCache`) and the fixed-capacity
    `static_cache.KDSAStaticCache` (a transformers `StaticCache`). `isinstance(cache, KDSACacheMixin)` asks "is this
    a cache a KDSA model can run on"; each subclass builds its own layers (`Cache.layers`) from the config and counts
    the tokens (`begin_forward`)."""

    def record_kda_inputs(self, layer_idx: int, inputs: KDAReplayRecord, kernels: KernelSet) -> None:
        """The KDA layer hands over its per-token replay inputs and the KernelSet it ran them with (what `crop`
        replays with) before its state update."""
        self.layers[layer_idx].record(inputs, kernels)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def memory_bytes(self) -> dict[str, int | float]:
        """Exact bytes held: `dsa_allocated` (page pools of the DSA and dense MLA layers), `dsa_in_use` (referenced
        pages), `kda_states` (conv windows + fp32 recurrent states), `kda_rollback` (KDA checkpoints + replay records),
        `total` (allocated + KDA), `per_token`: the paged bytes one cached token adds to one sequence (`Σ` over paged
        layers of its row in every plane: `(C + R + DI) · itemsize` per DSA layer and `(C + R) · itemsize` per dense
        MLA or shared-indexer layer unquantized, `(C + R + 2·DI + DI / kp) · itemsize` per k-pool DSA layer; see
        `KDSAPagedMLALayer.bytes_per_token`),
        and `rollback_per_token`: the record bytes one pending token adds to one sequence (all KDA layers)."""
        dsa_allocated = dsa_in_use = kda_states = kda_rollback = per_token = rollback_per_token = 0
        for layer in self.layers:
            if isinstance(layer, KDSAPagedMLALayer):
                usage = layer.memory_bytes()
                dsa_allocated += usage["allocated"]
                dsa_in_use += usage["in_use"]
                if layer.is_initialized:
                    per_token += layer.bytes_per_token()
            else:
                usage = layer.memory_bytes()
                kda_states += usage["states"]
                kda_rollback += usage["rollback"]
                rollback_per_token += usage["per_pending_token"]
        return {
            "dsa_allocated": dsa_allocated,
            "dsa_in_use": dsa_in_use,
            "kda_states": kda_states,
            "kda_rollback": kda_rollback,
            "total": dsa_allocated + kda_states + kda_rollback,
            "per_token": per_token,
            "rollback_per_token": rollback_per_token,
        }


class KDSACache(KDSACacheMixin, DynamicCache):
    """The cache `generate()` uses for KDSA models: a transformers `DynamicCache` (it grows with the sequence) whose
    layers are ours: `KDAReplayLayer` for KDA layers, `KDSAPagedLayer` for DSA
    layers (`KDSAPagedKPoolLayer` with the k-pool indexer), `KDSAPagedMLALayer` for dense MLA and shared-indexer DSA
    layers (`attention_store_class`).

    `max_cache_tokens`: optional capacity per sequence; a forward that would exceed it raises a `ValueError`
    before anything is written, so the cache stays usable.
    `rollback_tokens`: how many tokens since the last `crop` the KDA layers can roll back (see `KDAReplayLayer`).
    The default 0 keeps no replay records (no cost; a KDA rollback raises), because most forwards never crop;
    `generate()` passes `ROLLBACK_TOKENS` itself for assisted generation / prompt lookup and for draft models.
    Pass it yourself to `crop` a cache you drive by hand.
    DSA and dense MLA stores take their formats from `config.quantization_config`
    (`numeric_formats.CacheFormats.from_config`).
    Under `torch.compile` the page allocator is a graph break; `begin_forward` runs it for all layers before the
    decoder layers (docs/graph-mode.md §1). For a compiled decode step use the fixed-capacity sibling
    `static_cache.KDSAStaticCache` (a `StaticCache`) (`generate(cache_implementation="static")`, docs/graph-mode.md §2).
    """

    def __init__(
        self,
        config,
        max_cache_tokens: int | None = None,
        page_size: int = PAGE_SIZE,
        rollback_tokens: int = 0,
    ):
        layers = []
        for layer_idx, layer_type in enumerate(config.layer_types):
            if layer_type in (DSA_LAYER, MLA_LAYER):
                layers.append(attention_store_class(config, layer_idx).from_config(config, page_size))
            else:
                layers.append(KDAReplayLayer(config.linear_conv_kernel_dim, rollback_tokens))
        # `Cache.__init__`, not `DynamicCache.__init__`: the latter builds transformers' own layers from the config's
        # layer types (cache_utils.DYNAMIC_LAYER_TYPE_MAPPING); these layers are ours.
        Cache.__init__(self, layers=layers)
        if max_cache_tokens is not None and max_cache_tokens <= 0:
            raise ValueError(f"max_cache_tokens must be > 0 or None, got {max_cache_tokens}")
        self.max_cache_tokens = max_cache_tokens
        self.rollback_tokens = rollback_tokens
        self.num_tokens = 0

    def begin_forward(self, new_tokens: int, like: torch.Tensor | None = None) -> int:
        """Called by the model before its layers run: checks capacity and records the new tokens. With `like` (the
        input embeddings `[B, T, D]`), the paged layers also prepare their pages now (`KDSAPagedMLALayer.reserve`).
        Returns the number of tokens cached before them."""
        past = self.num_tokens
        self._check_capacity(past, new_tokens)
        if like is not None:
            for layer in self.layers:
                if isinstance(layer, KDSAPagedMLALayer):
                    layer.reserve(new_tokens, like)
        self.num_tokens = past + new_tokens
        return past

    def _check_capacity(self, past: int, new_tokens: int, holder: str = "the cache") -> None:
        """Refuse `new_tokens` more after `past` beyond `max_cache_tokens`, before anything is written."""
        if self.max_cache_tokens is not None and past + new_tokens > self.max_cache_tokens:
            raise ValueError(
                f"{type(self).__name__} capacity exceeded: {past} cached + {new_tokens} new tokens > max_cache_tokens="
                f"{self.max_cache_tokens}; nothing was written, {holder} still holds {past} tokens"
            )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.num_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch_size = next((layer.batch_size for layer in self.layers if isinstance(layer, KDSAPagedMLALayer)), None)
        if batch_size is None:
            raise ValueError("batch_repeat_interleave needs a paged (DSA or dense MLA) layer that knows the batch size")
        self.reorder_cache(torch.arange(batch_size).repeat_interleave(repeats))

    @property
    def is_croppable(self) -> bool:
        """True when `crop` is exact for every layer: DSA pages are truncated, KDA states replayed (needs
        rollback_tokens > 0). The rollback reaches back to the last crop, at most `rollback_tokens` tokens."""
        return all(layer.is_croppable for layer in self.layers if isinstance(layer, KDAReplayLayer))

    def crop(self, max_length: int) -> None:
        """Roll every layer back. `max_length < 0` removes `-max_length` tokens and `0` removes none (transformers
        5.x, which calls `crop(-rejected)` after every verification); `max_length > 0` keeps that many tokens.
        Commits the kept tokens (see `KDAReplayLayer`). Anything impossible raises before any layer changes."""
        new_length = self.num_tokens + max_length if max_length <= 0 else max_length
        if not 0 <= new_length <= self.num_tokens:
            raise ValueError(f"cannot crop a KDSACache holding {self.num_tokens} tokens to {new_length} tokens")
        for layer in self.layers:
            if isinstance(layer, KDAReplayLayer):
                layer.check_crop(new_length)
        for layer in self.layers:
            layer.crop(new_length)
        self.num_tokens = new_length

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.num_tokens = 0


__all__ = [
    "KDSACache",
    "KDSACacheMixin",
    "KDSAPagedKPoolLayer",
    "KDSAPagedLayer",
    "KDSAPagedMLALayer",
    "KDAReplayLayer",
    "KDAReplayRecord",
    "PAGE_SIZE",
    "ROLLBACK_TOKENS",
    "attention_store_class",
    "map_planes",
]
