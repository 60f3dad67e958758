"""DSA kernels, torch reference: Lightning Indexer scores and top-k, sparse MLA attention in absorbed form.

docs/dsa.md §1 (indexer formula and constant), §3 (absorbed / MQA mode, gather + softmax over the selected
entries), §5 (short context == dense causal MLA), §6 (-1 sentinel, lonely rows give 0), §7 (bounded prefill
logits). Each function does one job, in the style of vLLM's indexer stages; the layer (dsa.py) chains them per
block of queries so that a long prefill never holds a `[T, T]` tensor.

Index space: positions are indices into the layer's cache (0 = first cached token). A query at cache position `p`
sees the keys `s <= p` whose padding mask is 1.

Legend: `B` batch, `T` queries in the block, `S` keys, `H` MLA heads, `HI` indexer heads, `DI` indexer head dim,
`C` kv_lora_rank, `R` qk_rope_head_dim (0 for NoPE), `K` selected keys per query.
"""

import torch

# Query rows per prefill block: bounds the indexer logits to `[B, QUERY_BLOCK_SIZE, S]` and the gathered latent
# entries to `[B, QUERY_BLOCK_SIZE, K, C + R]`.
QUERY_BLOCK_SIZE = 128


def visible_keys_mask(
    query_start: int, num_queries: int, num_keys: int, key_padding_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Causal and padding visibility for queries at positions `query_start + i`, `i < num_queries`.

    key_padding_mask: `[B, S]` (1/True = real token) or None. Returns bool `[B or 1, T, S]`, True = visible.
    """
    query_positions = torch.arange(query_start, query_start + num_queries, device=device)
    key_positions = torch.arange(num_keys, device=device)
    visible = (key_positions[None, :] <= query_positions[:, None])[None]
    if key_padding_mask is not None:
        visible = visible & key_padding_mask.bool()[:, None, :]
    return visible


class ScoredPairs:
    """Counts the indexer's (query, key) scores that the kernels compute while it is active, summed over the batch:
    `with ScoredPairs() as scored: ...` then `scored.pairs`. Every indexer kernel reports the size of each block of
    scores it computes (masked pairs included: they cost the same), so this is the work done, not a formula."""

    _active: list["ScoredPairs"] = []

    def __init__(self):
        self.pairs = 0

    def __enter__(self) -> "ScoredPairs":
        ScoredPairs._active.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        ScoredPairs._active.remove(self)

    @classmethod
    def add(cls, scores: torch.Tensor) -> None:
        """Called by the kernels with every block of scores `[B, T, n]` they compute."""
        for counter in cls._active:
            counter.pairs += scores.numel()


def scaled_index_weights(weights: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The indexer's head weights `[..., HI]` (raw `weights_proj` output) in fp32, times `HI^-0.5 · DI^-0.5`: the
    factor every indexer kernel applies before the weighted head sum."""
    return weights.float() * (weights.shape[-1] ** -0.5 * head_dim**-0.5)


def indexer_scores(
    q_index: torch.Tensor, weights: torch.Tensor, k_index: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Lightning Indexer logits `I[t,s] = HI^-0.5 · DI^-0.5 · Σ_h w[t,h] · ReLU(q[t,h]·k[s])`, fp32.

    q_index: `[B, T, HI, DI]`; weights: `[B, T, HI]` (raw `weights_proj` output); k_index: `[B, S, DI]` (one key per
    token, shared by all heads); visible: bool `[B or 1, T, S]`. Returns `[B, T, S]` fp32, `-inf` where not visible.
    Heads are accumulated one at a time so that nothing larger than `[B, T, S]` is allocated.
    """
    num_heads, head_dim = q_index.shape[-2:]
    keys_t = k_index.float().transpose(1, 2)  # [B, DI, S]
    weights = scaled_index_weights(weights, head_dim)
    scores = None
    for head in range(num_heads):
        head_logits = torch.relu(torch.bmm(q_index[:, :, head].float(), keys_t)) * weights[:, :, head, None]
        scores = head_logits if scores is None else scores + head_logits
    ScoredPairs.add(scores)
    return scores.masked_fill(~visible, float("-inf"))


def select_topk(scores: torch.Tensor, index_topk: int) -> torch.Tensor:
    """Top-`min(index_topk, S)` keys per query from indexer logits `[B, T, S]`.

    Returns int64 `[B, T, K]`: valid key positions first (by descending score), `-1` in slots that would pick a
    key that is not visible (score `-inf`), e.g. for early rows that see fewer than K keys.
    Equal scores go to the earlier key (a stable sort), so the selection does not depend on how many keys or
    queries share the call: exact ties are common because ReLU zeroes every head of some keys (score exactly 0).
    """
    k = min(index_topk, scores.shape[-1])
    values, indices = scores.sort(dim=-1, descending=True, stable=True)
    values, indices = values[..., :k], indices[..., :k]
    return indices.masked_fill(values == float("-inf"), -1)


def indexer_topk(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    k_index: torch.Tensor,
    index_topk: int,
    query_start: int,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer top-k for one block of queries at positions `query_start + i` (docs/dsa.md §1, §6).

    q_index: `[B, T, HI, DI]`; weights: `[B, T, HI]`; k_index: `[B, S, DI]`; key_padding_mask: `[B, S]` or None.
    Returns int64 `[B, T, min(index_topk, S')]`, one index set per query shared by all MLA heads, `-1` = no key,
    where `S' = min(S, query_start + T)`: keys after the block's last query are never visible, so not scored.
    """
    num_keys = min(k_index.shape[1], query_start + q_index.shape[1])
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask[:, :num_keys]
    visible = visible_keys_mask(query_start, q_index.shape[1], num_keys, key_padding_mask, q_index.device)
    return select_topk(indexer_scores(q_index, weights, k_index[:, :num_keys], visible), index_topk)


def kpool_origin(key_padding_mask: torch.Tensor | None, batch: int, num_keys: int, device) -> torch.Tensor:
    """First real key of every sequence, where its k-pools start (docs/dsa.md §9): int64 `[B]`.

    key_padding_mask `[B, S]` (1 = real) must be left padding (zeros, then ones); None = nothing padded (origin 0).
    A row without a real key gets `S`.
    """
    if key_padding_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    mask = key_padding_mask[:, :num_keys].bool()
    if num_keys > 1 and bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError(
            "attention_mask must be left padding (zeros, then ones) for the k-pool indexer (index_kpool > 1): its "
            "pools start at each sequence's first real token"
        )
    return num_keys - mask.sum(-1)


def kpool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pooled indexer keys: per channel, a softmax over the `kp` tokens of a pool of `gate + ape` (docs/dsa.md §9).

    keys, gates: `[..., kp, DI]` (normalised keys, gate scores); ape: `[kp, DI]`. Logits and softmax in fp32, the
    weighted sum in the keys' dtype, as GLM-5.3-Flash. Returns `[..., DI]`.
    """
    probs = (gates.float() + ape.float()).softmax(dim=-2).to(keys.dtype)
    return (probs * keys).sum(dim=-2)


def kpool_expand(
    pool_ends: torch.Tensor,
    kpool: int,
    query_start: int | torch.Tensor,
    origin: torch.Tensor,
    select_tail: bool,
) -> torch.Tensor:
    """Selected pools -> token positions, then the tail (docs/dsa.md §9).

    pool_ends: int64 `[B, T, Kp]` last token of each selected pool, -1 = none; origin `[B]` (`kpool_origin`).
    Returns int64 `[B, T, Kp * kp (+ kp - 1 with the tail)]`: each pool's tokens in order, then the query's own
    incomplete pool (its last `(q - origin + 1) mod kp` tokens, ending at the query), -1 = none.
    """
    offsets = torch.arange(1 - kpool, 1, device=pool_ends.device)
    tokens = (pool_ends[..., None] + offsets).masked_fill(pool_ends[..., None] < 0, -1).flatten(-2)
    if not select_tail or kpool == 1:
        return tokens
    batch, num_queries = pool_ends.shape[:2]
    # `query_start` may be a 0-d tensor (a compiled static-cache step): no host read of it.
    positions = query_start + torch.arange(num_queries, device=pool_ends.device)
    seen = positions[None, :] - origin[:, None] + 1  # [B, T] real keys the query sees (<= 0: a padded query)
    tail_count = seen.clamp(min=0) % kpool
    slot = torch.arange(kpool - 1, device=pool_ends.device)
    tail = positions[None, :, None] - tail_count[..., None] + 1 + slot
    tail = tail.masked_fill(slot >= tail_count[..., None], -1)
    return torch.cat([tokens, tail], dim=-1)


def kpool_indexer_topk(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    index_rows: torch.Tensor,
    ape: torch.Tensor,
    index_topk: int,
    query_start: int,
    key_padding_mask: torch.Tensor | None = None,
    select_tail: bool = True,
    origin: torch.Tensor | None = None,
) -> torch.Tensor:
    """k-pool indexer top-k (GLM-5.3-Flash; docs/dsa.md §9), reference: pools every call from the token rows.

    q_index `[B, T, HI, DI]`; weights `[B, T, HI]`; index_rows `[B, S, 2·DI]` per token `[normalised key | gate
    score]`; ape `[kp, DI]`; key_padding_mask `[B, S]` left padding or None. Pool `j` of sequence `b` is the tokens
    `origin_b + j·kp ..` (+kp - 1); a query sees a pool when its last token is at or before the query. The
    `min(index_topk // kp, S' // kp)` best visible pools (scores as `indexer_scores`; equal scores: earlier pool
    first), expanded to their tokens, then the tail (`kpool_expand`). `S' = min(S, query_start + T)`. origin `[B]`:
    each sequence's first real token when the caller keeps it (a cache's `pool_origin`), else `kpool_origin` of the
    mask. Returns int64 `[B, T, K]`, -1 = none.
    """
    batch, num_queries = q_index.shape[:2]
    kpool, head_dim = ape.shape
    num_keys = min(index_rows.shape[1], query_start + num_queries)
    if origin is None:
        origin = kpool_origin(key_padding_mask, batch, num_keys, q_index.device)
    num_pools = num_keys // kpool
    starts = origin[:, None] + kpool * torch.arange(num_pools, device=q_index.device)  # [B, J]
    ends = starts + kpool - 1
    complete = ends < num_keys
    token_ids = (starts[..., None] + torch.arange(kpool, device=q_index.device)).clamp(max=max(num_keys - 1, 0))
    rows = index_rows.gather(1, token_ids.flatten(1)[..., None].expand(-1, -1, index_rows.shape[-1]))
    rows = rows.view(batch, num_pools, kpool, -1)
    pooled = kpool_keys(rows[..., :head_dim], rows[..., head_dim:], ape)  # [B, J, DI]
    positions = torch.arange(query_start, query_start + num_queries, device=q_index.device)
    visible = complete[:, None, :] & (ends[:, None, :] <= positions[None, :, None])  # [B, T, J]
    selected = select_topk(indexer_scores(q_index, weights, pooled, visible), index_topk // kpool)
    pool_ends = torch.where(selected >= 0, ends.gather(1, selected.clamp(min=0).flatten(1)).view_as(selected), -1)
    return kpool_expand(pool_ends, kpool, query_start, origin, select_tail)


def sparse_mla_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Sparse MLA in absorbed form over exactly the selected latent entries (docs/dsa.md §3).

    q_latent: `[B, T, H, C]` (`W_UK^T q_nope`); q_pe: `[B, T, H, R]`; latent: `[B, S, C]` (normalised `c`);
    k_pe: `[B, S, R]` (RoPE'd); indices: `[B, T, K]` int, `-1` = no key. Returns the latent-space output
    `o_lat = Σ_k softmax_k((q_latent·c_k + q_pe·k_pe_k) · scale) · c_k`, `[B, T, H, C]` in `q_latent`'s dtype.
    Products accumulate and the softmax runs in fp32; rows without a valid index give 0.
    """
    batch, num_queries, num_selected = indices.shape
    valid = indices >= 0
    flat_indices = indices.clamp(min=0).reshape(batch, num_queries * num_selected, 1)
    selected_latent = latent.gather(1, flat_indices.expand(-1, -1, latent.shape[-1]))
    selected_latent = selected_latent.view(batch, num_queries, num_selected, -1).float()  # [B, T, K, C]
    selected_pe = k_pe.gather(1, flat_indices.expand(-1, -1, k_pe.shape[-1]))
    selected_pe = selected_pe.view(batch, num_queries, num_selected, -1).float()  # [B, T, K, R]

    # [B, T, H, C] @ [B, T, C, K] -> [B, T, H, K]; the rope term is empty (adds 0) for NoPE.
    scores = torch.matmul(q_latent.float(), selected_latent.transpose(-1, -2))
    scores = scores + torch.matmul(q_pe.float(), selected_pe.transpose(-1, -2))
    scores = (scores * softmax_scale).masked_fill(~valid[:, :, None, :], float("-inf"))

    # A row with no valid key would give NaN (all -inf); give it zero weights instead, i.e. output 0.
    row_max = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    probs = torch.exp(scores - row_max)
    denominator = probs.sum(dim=-1, keepdim=True)
    probs = probs / denominator.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.matmul(probs, selected_latent).to(q_latent.dtype)


def dense_mla_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    softmax_scale: float,
    query_start: int = 0,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal MLA in absorbed form over every visible latent entry (docs/dsa.md §8): the dense-MLA layer's
    reference kernel.

    q_latent: `[B, T, H, C]`; q_pe: `[B, T, H, R]`; latent: `[B, S, C]`; k_pe: `[B, S, R]`; queries sit at positions
    `query_start + i`; key_padding_mask `[B, S]` or None. Returns `o_lat = Σ_s softmax_s((q_latent·c_s + q_pe·k_pe_s)
    · scale) · c_s` over the keys `s <= query_start + i` that are not padding, `[B, T, H, C]` in `q_latent`'s dtype.
    fp32 math; rows without a visible key give 0.
    """
    visible = visible_keys_mask(query_start, q_latent.shape[1], latent.shape[1], key_padding_mask, latent.device)
    scores = torch.einsum("bthc,bsc->bths", q_latent.float(), latent.float())
    scores = scores + torch.einsum("bthr,bsr->bths", q_pe.float(), k_pe.float())
    scores = (scores * softmax_scale).masked_fill(~visible[:, :, None, :], float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    probs = torch.exp(scores - row_max)
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.einsum("bths,bsc->bthc", probs, latent.float()).to(q_latent.dtype)


__all__ = [
    "QUERY_BLOCK_SIZE",
    "ScoredPairs",
    "visible_keys_mask",
    "indexer_scores",
    "select_topk",
    "indexer_topk",
    "kpool_origin",
    "kpool_keys",
    "kpool_expand",
    "kpool_indexer_topk",
    "sparse_mla_attention",
    "dense_mla_attention",
]
