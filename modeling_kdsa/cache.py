"""KDSACache: the generation cache of a KDSA model (DESIGN.md §3; reference/dsa.md §2.2, §3, §4.1).

- KDA layers keep the short-conv window and the fp32 recurrent state per sequence (transformers'
  `LinearAttentionLayer`, unchanged).
- DSA layers keep a **paged** store (`KDSAPagedLayer`): fixed-size pages of `page_size` tokens in one pool per
  layer, and a block table per sequence mapping logical pages to physical pages. Each token row holds the
  normalised MLA latent and the RoPE'd key `[c | k_pe]` (`kv_pages`) and the indexer key (`index_pages`). Pages are
  allocated as sequences grow; beams that share a prefix after `reorder_cache` share its pages (reference counts,
  copy-on-write for the page being filled).
- The store, not the layer, calls the kernels that read it (`dsa_paged_ops`): the fused indexer/top-k and the sparse
  attention over the selected entries, chosen by `config.kernel_backend`.

Every sequence of a batch has the same number of cached tokens (generate left-pads); padding is described by the
attention mask the model passes to the kernels.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

from .configuration_kdsa import DSA_LAYER
from .dsa_paged_ops import dsa_kernels

PAGE_SIZE = 64  # tokens per page: the CUDA DSA kernels' block size (reference/dsa.md §4.2, §8.7)


def resolve_kernel_backend(backend: str, device: torch.device) -> str:
    """`auto` picks the fastest backend that has run on this device: the fused CPU kernels on CPU. Anything else
    (CUDA, NPU) falls back to the torch reference until a kernel for it has been verified on its hardware."""
    if backend != "auto":
        return backend
    return "cpu" if device.type == "cpu" else "torch"


class KDSAPagedLayer(CacheLayerMixin):
    """Paged latent + indexer-key store of one DSA layer.

    kv_pages: `[P, page_size, C + R]`, index_pages: `[P, page_size, DI]` (model dtype), block_table: int64
    `[B, pages per sequence]` (-1 = unused), `num_tokens`: cached tokens per sequence. Physical pages come from a
    pool that doubles when it runs out; `page_refcount[p]` counts the block-table entries pointing at page `p`.
    """

    def __init__(self, kv_width: int, index_width: int, kernel_backend: str, page_size: int = PAGE_SIZE):
        super().__init__()
        self.kv_width = kv_width
        self.index_width = index_width
        self.kernel_backend = kernel_backend
        self.page_size = page_size
        self.kv_pages: torch.Tensor | None = None
        self.index_pages: torch.Tensor | None = None
        self.block_table: torch.Tensor | None = None
        self.page_refcount: list[int] = []
        self.free_pages: list[int] = []
        self.num_tokens = 0

    # ---------------------------------------------------------------------------------------------- bookkeeping
    def lazy_initialization(self, kv_rows: torch.Tensor, index_keys: torch.Tensor) -> None:
        batch_size = kv_rows.shape[0]
        self.dtype, self.device = kv_rows.dtype, kv_rows.device
        self.kv_pages = kv_rows.new_zeros(0, self.page_size, self.kv_width)
        self.index_pages = index_keys.new_zeros(0, self.page_size, self.index_width)
        self.block_table = torch.full((batch_size, 0), -1, dtype=torch.long, device=self.device)
        self.kernels = dsa_kernels(resolve_kernel_backend(self.kernel_backend, self.device))
        self.is_initialized = True

    @property
    def batch_size(self) -> int:
        return 0 if self.block_table is None else self.block_table.shape[0]

    def _grow_pool(self, min_free: int) -> None:
        """Make at least `min_free` pages free, doubling the pool (amortised O(1) per page)."""
        missing = min_free - len(self.free_pages)
        if missing <= 0:
            return
        old = self.kv_pages.shape[0]
        new = max(2 * old, old + missing, 4)
        kv_pages = self.kv_pages.new_zeros(new, self.page_size, self.kv_width)
        index_pages = self.index_pages.new_zeros(new, self.page_size, self.index_width)
        kv_pages[:old] = self.kv_pages
        index_pages[:old] = self.index_pages
        self.kv_pages, self.index_pages = kv_pages, index_pages
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
        if last_page >= table.shape[1]:
            pad = torch.full(
                (table.shape[0], last_page + 1 - table.shape[1]), -1, dtype=torch.long, device=table.device
            )
            table = torch.cat([table, pad], dim=1)
        rows = table.tolist()
        shared_partial = self.num_tokens % self.page_size != 0
        needed = sum(1 for row in rows for p in range(first_page, last_page + 1) if row[p] < 0)
        if shared_partial:
            needed += sum(1 for row in rows if self.page_refcount[row[first_page]] > 1)
        self._grow_pool(needed)
        for row in rows:
            if shared_partial and self.page_refcount[row[first_page]] > 1:
                shared, private = row[first_page], self._take_page()
                self.kv_pages[private] = self.kv_pages[shared]
                self.index_pages[private] = self.index_pages[shared]
                self._release(shared)
                row[first_page] = private
            for p in range(first_page, last_page + 1):
                if row[p] < 0:
                    row[p] = self._take_page()
        self.block_table = torch.tensor(rows, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------------------------------------- writes
    def append(self, kv_rows: torch.Tensor, index_keys: torch.Tensor) -> int:
        """Store the current tokens: kv_rows `[B, T, C + R]`, index_keys `[B, T, DI]`. Returns the number of tokens
        cached before them (the position of the first new token)."""
        if kv_rows.shape[-1] != self.kv_width or index_keys.shape[-1] != self.index_width:
            raise ValueError(
                f"paged DSA store expects rows of width {self.kv_width} and indexer keys of width {self.index_width}, "
                f"got {tuple(kv_rows.shape)} and {tuple(index_keys.shape)}"
            )
        if not self.is_initialized:
            self.lazy_initialization(kv_rows, index_keys)
        batch_size, new_tokens, _ = kv_rows.shape
        if batch_size != self.batch_size:
            raise ValueError(f"cache holds {self.batch_size} sequences, got a batch of {batch_size}")
        past = self.num_tokens
        if new_tokens == 0:
            return past
        self._prepare_pages(new_tokens)
        slots = self.physical_slots(torch.arange(past, past + new_tokens, device=self.device).expand(batch_size, -1))
        self.kv_pages.view(-1, self.kv_width)[slots.reshape(-1)] = kv_rows.reshape(-1, self.kv_width).to(self.dtype)
        self.index_pages.view(-1, self.index_width)[slots.reshape(-1)] = index_keys.reshape(-1, self.index_width).to(
            self.dtype
        )
        self.num_tokens = past + new_tokens
        return past

    def physical_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Logical token positions `[B, N]` → row indices into `kv_pages.view(-1, width)`."""
        pages = self.block_table.gather(1, positions // self.page_size)
        return pages * self.page_size + positions % self.page_size

    # -------------------------------------------------------------------------------------------------- reads
    def indexer_topk(
        self,
        q_index: torch.Tensor,
        weights: torch.Tensor,
        query_start: int,
        index_topk: int,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Top-`index_topk` cached positions per query (fused indexer over the pages); see dsa_paged_ops."""
        indexer, _ = self.kernels
        return indexer(
            q_index, weights, self.index_pages, self.block_table, self.num_tokens, index_topk, query_start,
            key_padding_mask,
        )  # fmt: skip

    def sparse_attention(
        self, q_latent: torch.Tensor, q_pe: torch.Tensor, indices: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        """Absorbed-form attention over exactly the selected cached entries; see dsa_paged_ops."""
        _, attention = self.kernels
        return attention(q_latent, q_pe, self.kv_pages, self.block_table, indices, softmax_scale)

    # -------------------------------------------------------------------------- transformers CacheLayerMixin API
    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("KDSAPagedLayer is written through `append` by the KDSA sparse attention layer")

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
            raise ValueError(f"cannot crop a DSA layer holding {self.num_tokens} tokens to {new_length} tokens")
        if not self.is_initialized or new_length == self.num_tokens:
            return
        keep_pages = -(-new_length // self.page_size)
        for page in self.block_table[:, keep_pages:].reshape(-1).tolist():
            if page >= 0:
                self._release(page)
        self.block_table = self.block_table[:, :keep_pages].clone()
        self.num_tokens = new_length

    def reset(self) -> None:
        self.__init__(self.kv_width, self.index_width, self.kernel_backend, self.page_size)

    def memory_bytes(self) -> dict[str, int]:
        """`allocated`: the page pool; `in_use`: pages some sequence points at (shared pages counted once)."""
        if not self.is_initialized:
            return {"allocated": 0, "in_use": 0}
        page_bytes = (self.kv_pages[0].nbytes + self.index_pages[0].nbytes) if self.kv_pages.shape[0] else 0
        in_use = sum(1 for count in self.page_refcount if count > 0)
        return {"allocated": self.kv_pages.nbytes + self.index_pages.nbytes, "in_use": in_use * page_bytes}


class KDSACache(Cache):
    """The cache `generate()` uses for KDSA models: `LinearAttentionLayer` for KDA layers, `KDSAPagedLayer` for DSA
    layers.

    `max_cache_tokens`: optional capacity per sequence; a forward that would exceed it raises a `ValueError`
    before anything is written, so the cache stays usable.
    """

    def __init__(self, config, max_cache_tokens: int | None = None, page_size: int = PAGE_SIZE):
        layers = []
        for layer_type in config.layer_types:
            if layer_type == DSA_LAYER:
                layers.append(
                    KDSAPagedLayer(
                        kv_width=config.kv_lora_rank + config.qk_rope_head_dim,
                        index_width=config.index_head_dim,
                        kernel_backend=config.kernel_backend,
                        page_size=page_size,
                    )
                )
            else:
                layers.append(LinearAttentionLayer())
        super().__init__(layers=layers)
        if max_cache_tokens is not None and max_cache_tokens <= 0:
            raise ValueError(f"max_cache_tokens must be > 0 or None, got {max_cache_tokens}")
        self.max_cache_tokens = max_cache_tokens
        self.num_tokens = 0

    def begin_forward(self, new_tokens: int) -> int:
        """Called by the model before its layers run: checks capacity and records the new tokens.
        Returns the number of tokens cached before them."""
        past = self.num_tokens
        if self.max_cache_tokens is not None and past + new_tokens > self.max_cache_tokens:
            raise ValueError(
                f"KDSACache capacity exceeded: {past} cached + {new_tokens} new tokens > max_cache_tokens="
                f"{self.max_cache_tokens}; nothing was written, the cache still holds {past} tokens"
            )
        self.num_tokens = past + new_tokens
        return past

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.num_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch_size = next((layer.batch_size for layer in self.layers if isinstance(layer, KDSAPagedLayer)), None)
        if batch_size is None:
            raise ValueError("batch_repeat_interleave needs a DSA layer that knows the batch size")
        self.reorder_cache(torch.arange(batch_size).repeat_interleave(repeats))

    @property
    def is_croppable(self) -> bool:
        # The KDA recurrent state cannot be rolled back yet (state replay is the speculative-decoding issue).
        return not any(isinstance(layer, LinearAttentionLayer) for layer in self.layers)

    def crop(self, max_length: int) -> None:
        if not self.is_croppable:
            raise ValueError(
                "KDSACache.crop cannot roll back KDA recurrent states yet; only models without KDA layers can crop"
            )
        for layer in self.layers:
            layer.crop(max_length)
        self.num_tokens = self.layers[0].num_tokens

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.num_tokens = 0

    def memory_bytes(self) -> dict[str, int | float]:
        """Exact bytes held: `dsa_allocated` (page pools), `dsa_in_use` (referenced pages), `kda_states` (conv windows
        + fp32 recurrent states), `total` (allocated + KDA), and `per_token`: the DSA bytes one cached token adds to
        one sequence (`Σ_DSA layers (C + R + DI) · itemsize`)."""
        dsa_allocated = dsa_in_use = kda_states = per_token = 0
        for layer in self.layers:
            if isinstance(layer, KDSAPagedLayer):
                usage = layer.memory_bytes()
                dsa_allocated += usage["allocated"]
                dsa_in_use += usage["in_use"]
                if layer.is_initialized:
                    per_token += (layer.kv_width + layer.index_width) * layer.kv_pages.element_size()
            else:
                states = list(layer.conv_states.values()) + list(layer.recurrent_states.values())
                kda_states += sum(state.nbytes for state in states if state is not None)
        return {
            "dsa_allocated": dsa_allocated,
            "dsa_in_use": dsa_in_use,
            "kda_states": kda_states,
            "total": dsa_allocated + kda_states,
            "per_token": per_token,
        }


__all__ = ["KDSACache", "KDSAPagedLayer", "PAGE_SIZE", "resolve_kernel_backend"]
