"""Block Attention Residuals (AttnRes): softmax attention over depth replaces the unit-weight residual sum.

Math: docs/attn-res.md §1 (depth attention), §2 (block representations and partial sums, the reference forward
this module reproduces, the layout Kimi K3 serves) and §3 (two-phase computation).

Each sublayer (token mixer or FFN) owns a `KDSADepthAttention`: a learned pseudo-query `w` and an RMSNorm on the
keys. Its input is `Σ_i softmax_i(wᵀ RMSNorm(v_i)) · v_i` over the sources `v_i` (completed block representations
and the running partial sum of the current block). AttnRes is position-wise: nothing here reads another token, so
it needs no cache entries and works for any `[B, T]`, decode (`T = 1`) included.
"""

import copy

import torch
from torch import nn

from .norms import KDSARMSNorm, join_segments, token_segments


class KDSADepthAttention(nn.Module):
    """One sublayer's depth attention (docs/attn-res.md §1): pseudo-query `query: [D]` and key norm `key_norm`.

    The query is zero-initialised so that training starts from the uniform average of the sources. There is no
    1/√D temperature: the key RMSNorm keeps large-magnitude sources from dominating.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        # fp32 whatever the default dtype (`_keep_in_fp32_modules_strict` only applies when loading weights).
        self.query = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))
        self.key_norm = KDSARMSNorm(hidden_size, eps=eps).float()

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """Direct formula. `sources`: n tensors `[B, T, D]` → `[B, T, D]` in the sources' dtype. Position-wise, so a
        long sequence runs in token segments (docs/design.md §12)."""
        segments = token_segments(sources[0].shape[1])
        return join_segments([self._attend([source[:, part] for source in sources]) for part in segments], dim=1)

    def _attend(self, sources: list[torch.Tensor]) -> torch.Tensor:
        values = torch.stack(sources)  # [n, B, T, D]
        # A product and a sum rather than a GEMV: a loaded query may sit at any alignment inside the checkpoint's
        # memory map, and the BLAS GEMV's rounding depends on it (a model and its reload gave different bits).
        logits = (self.key_norm(values).float() * self.query.float()).sum(dim=-1)
        weights = logits.softmax(dim=0)  # fp32 softmax over depth (docs/design.md §6)
        return torch.einsum("nbt,nbtd->btd", weights, values.float()).to(values.dtype)


class BlockAttnResStream:
    """The residual stream of one forward pass under Block AttnRes (docs/attn-res.md §2).

    Sublayer `s` (`2·layer` for the token mixer, `2·layer + 1` for the FFN) belongs to block `s // block_size`. The
    embedding is the first block representation `b_0`. The first sublayer of a block attends over the completed
    blocks `[b_0 … b_{n-1}]` (the previous partial sum is committed as a block right then); a later sublayer attends
    over `[b_0 … b_{n-1}, partial]`, where `partial` is the plain sum of the current block's sublayer outputs so far.
    A trailing block shorter than `block_size` is simply a smaller block.

    Usage, once per forward pass: `h = stream.input_for(s)`, then `stream.add_output(s, f_s(norm(h)))` for
    s = 0, 1, …, then `stream.final(...)`.

    `two_phase=True` (docs/attn-res.md §3) computes the same result as `two_phase=False` (the direct formula) with
    the inter-block part batched once per block:
    - phase 1, at a block's first sublayer: for all of the block's queries at once, the softmax statistics over the
      completed blocks (running max `m`, denominator `ℓ`, numerator `o`), with each query's RMSNorm gain folded
      into it (`wᵀ(g ⊙ x / rms(x)) = (w ⊙ g)ᵀ x / rms(x)`) and `rms(b_j)` computed once per block representation;
    - phase 2, per sublayer: the merge of those statistics with the one intra-block source, the partial sum. Phase 1
      keeps, per query, the softmax output over the blocks alone `o_blocks` and its log-sum-exp `a`; with the
      partial's logit `l`, the two-source softmax is `o = o_blocks + σ(l − a)·(partial − o_blocks)` (one `lerp`:
      the partial's weight is `e^l / (e^a + e^l) = σ(l − a)`), a few element-wise ops per sublayer at decode.
    Transient memory: the completed blocks `n·[B, T, D]` plus phase-1 statistics `block_size·[B, T, D]` in fp32.
    """

    def __init__(
        self,
        embeddings: torch.Tensor,
        block_size: int,
        depth_attns: list[KDSADepthAttention],
        two_phase: bool = True,
    ):
        """`embeddings: [B, T, D]`; `depth_attns[s]` is sublayer s's depth attention, one per sublayer."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0 for Block AttnRes, got {block_size}")
        if not depth_attns:
            raise ValueError("depth_attns is empty: Block AttnRes needs one depth attention per sublayer")
        epsilons = {attn.key_norm.variance_epsilon for attn in depth_attns}
        if len(epsilons) > 1:
            # Phase 1 computes rms(b_j) once for all queries, so every key norm must share its epsilon.
            raise ValueError(f"all depth attentions must use the same key-norm eps, got {sorted(epsilons)}")
        self.block_size = block_size
        self.depth_attns = depth_attns
        self.two_phase = two_phase
        self.eps = epsilons.pop()
        self.blocks: list[torch.Tensor] = []  # completed block representations b_0 … b_{n-1}, each [B, T, D]
        self.block_inv_rms: list[torch.Tensor] = []  # 1/rms(b_j), [B, T] fp32 (two-phase only)
        self.partial: torch.Tensor | None = embeddings  # the embedding is committed as b_0 by sublayer 0
        self.next_sublayer = 0
        self.awaiting_output = False
        # Phase-1 statistics of the current block, one row per sublayer of the block (two-phase only).
        self.block_first_sublayer = 0
        self.block_queries: torch.Tensor | None = None  # [S, D] fp32, gain-folded queries
        self.block_output: torch.Tensor | None = None  # [S, B, T, D] fp32: softmax over the completed blocks only
        self.block_log_sum_exp: torch.Tensor | None = None  # [S, B, T] fp32: log Σ_j exp(logit_j) over those blocks

    def input_for(self, sublayer_idx: int) -> torch.Tensor:
        """Depth-attended input `[B, T, D]` of sublayer `sublayer_idx` (call before its `add_output`)."""
        if self.awaiting_output or sublayer_idx != self.next_sublayer:
            raise ValueError(
                f"input_for({sublayer_idx}) out of order: expected "
                + (f"add_output({self.next_sublayer})" if self.awaiting_output else f"input_for({self.next_sublayer})")
            )
        if sublayer_idx >= len(self.depth_attns):
            raise ValueError(f"sublayer {sublayer_idx} has no depth attention ({len(self.depth_attns)} given)")
        self.awaiting_output = True
        block_start = sublayer_idx % self.block_size == 0
        if block_start:
            self._commit_block()
        if not self.two_phase:
            sources = self.blocks if block_start else [*self.blocks, self.partial]
            return self.depth_attns[sublayer_idx](sources)
        if block_start:
            self._inter_block_statistics(sublayer_idx)
        return self._merge_partial(sublayer_idx, None if block_start else self.partial)

    def add_output(self, sublayer_idx: int, output: torch.Tensor) -> None:
        """Add sublayer `sublayer_idx`'s output `[B, T, D]` to the current block's partial sum."""
        if not self.awaiting_output or sublayer_idx != self.next_sublayer:
            raise ValueError(f"add_output({sublayer_idx}) must follow input_for({sublayer_idx})")
        self.partial = output if self.partial is None else self.partial + output
        self.awaiting_output = False
        self.next_sublayer += 1

    def copy(self) -> "BlockAttnResStream":
        """An independent stream in the same state (the tensors shared, never modified in place; the block lists
        copied), for a layer that must leave its input stream as it was (docs/design.md §10)."""
        clone = copy.copy(self)
        clone.blocks, clone.block_inv_rms = list(self.blocks), list(self.block_inv_rms)
        return clone

    def final(self, depth_attn: KDSADepthAttention | None = None) -> torch.Tensor:
        """The stream's output `[B, T, D]`, to be fed to the final norm, after every sublayer has run.

        With `depth_attn` (final aggregation): depth attention over all completed blocks and the last partial.
        Without: the plain sum of all blocks and the partial, i.e. `embedding + Σ_s f_s`, the value a standard
        residual stream would end with. Choice: it keeps every block's contribution (feeding only the last partial
        to the norm, as one port does, would drop the embedding and all earlier blocks from the head's input), and
        after the final RMSNorm it equals a zero-query final aggregation (the uniform average), up to the norm's eps.
        """
        if self.awaiting_output or self.next_sublayer != len(self.depth_attns):
            raise ValueError(
                f"final() called after {self.next_sublayer} of {len(self.depth_attns)} sublayers"
                + (" (the last one still awaits add_output)" if self.awaiting_output else "")
            )
        sources = [*self.blocks, self.partial]
        if depth_attn is not None:  # one query: the direct formula, nothing to batch
            return depth_attn(sources)
        return torch.stack(sources).sum(dim=0)

    def _commit_block(self) -> None:
        """Close the current block: its partial sum becomes the next block representation."""
        self.blocks.append(self.partial)
        if self.two_phase:
            self.block_inv_rms.append(self._inv_rms(self.partial))
        self.partial = None

    def _inv_rms(self, x: torch.Tensor) -> torch.Tensor:
        """`1 / rms(x)` over the hidden dim, as `KDSARMSNorm` computes it: `[B, T, D]` → `[B, T]` fp32."""
        parts = [torch.rsqrt(x[:, part].float().pow(2).mean(dim=-1) + self.eps) for part in token_segments(x.shape[1])]
        return join_segments(parts, dim=1)  # docs/design.md §12

    def _inter_block_statistics(self, first_sublayer: int) -> None:
        """Phase 1: softmax statistics over the completed blocks for every query of the block starting here."""
        attns = self.depth_attns[first_sublayer : first_sublayer + self.block_size]
        # Fold each RMSNorm gain into its query: the keys b_j / rms(b_j) are then shared by all queries.
        queries = torch.stack([a.query for a in attns]).float()
        self.block_queries = queries * torch.stack([a.key_norm.weight for a in attns]).float()  # [S, D]
        self.block_first_sublayer = first_sublayer
        # Position-wise: a long sequence runs in token segments (docs/design.md §12), each writing its tokens'
        # statistics into the full-length tensors.
        batch_size, seq_len, hidden_size = self.blocks[0].shape
        self.block_output = self.blocks[0].new_empty(len(attns), batch_size, seq_len, hidden_size, dtype=torch.float32)
        self.block_log_sum_exp = self.blocks[0].new_empty(len(attns), batch_size, seq_len, dtype=torch.float32)
        for part in token_segments(seq_len):
            values = torch.stack([block[:, part] for block in self.blocks]).float()  # [n, B, t, D]
            inv_rms = torch.stack([inv[:, part] for inv in self.block_inv_rms])  # [n, B, t]
            logits = torch.einsum("sd,nbtd->snbt", self.block_queries, values) * inv_rms  # [S, n, B, t]
            max_ = logits.amax(dim=1)  # [S, B, t]
            exp = (logits - max_.unsqueeze(1)).exp()
            denominator = exp.sum(dim=1)  # [S, B, t], >= 1
            self.block_output[:, :, part] = torch.einsum("snbt,nbtd->sbtd", exp, values) / denominator.unsqueeze(-1)
            self.block_log_sum_exp[:, :, part] = max_ + denominator.log()

    def _merge_partial(self, sublayer_idx: int, partial: torch.Tensor | None) -> torch.Tensor:
        """Phase 2: two-source softmax of the blocks' statistics and the partial sum (None at a block start)."""
        slot = sublayer_idx - self.block_first_sublayer
        out_dtype = self.blocks[0].dtype
        if partial is None:
            return self.block_output[slot].to(out_dtype)
        # Position-wise: token segments (docs/design.md §12); one segment needs no concatenation (a decode step).
        segments = token_segments(partial.shape[1])
        return join_segments([self._merge_segment(slot, partial[:, part], part).to(out_dtype) for part in segments], 1)

    def _merge_segment(self, slot: int, partial: torch.Tensor, part: slice) -> torch.Tensor:
        """`_merge_partial` for the tokens `part` (`partial` holds just those): fp32 `[B, t, D]`."""
        partial = partial.float()
        logit = (partial * self.block_queries[slot]).sum(dim=-1) * self._inv_rms(partial)  # [B, t]
        partial_weight = torch.sigmoid(logit - self.block_log_sum_exp[slot][:, part])  # its softmax weight vs blocks
        return torch.lerp(self.block_output[slot][:, part], partial, partial_weight.unsqueeze(-1))


__all__ = ["KDSADepthAttention", "BlockAttnResStream"]
