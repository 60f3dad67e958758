"""KDA (Kimi Delta Attention) kernels in plain torch: recurrent and chunked delta rule, gate, l2norm, short conv.

Math: docs/kda.md §2 (gate), §3 (recurrence), §5 (chunked WY/UT form), §6 (short conv, l2norm).
Shapes: `q, k, g: [B, T, H, K]`, `v: [B, T, H, V]`, `beta: [B, T, H]`, `state: [B, H, K, V]` (rows are key
channels, because the decay acts per key channel). `g` is the natural-log decay (<= 0). Both kernels compute in
fp32, return `o` in `v.dtype` and the state in fp32, and agree with each other to fp32 rounding.
"""

from functools import partial

import torch
import torch.nn.functional as F

from .linear_ops import product


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x²) + eps)` over the last dim: fla's l2norm (eps inside the sqrt, unlike `F.normalize`)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(
    raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None
) -> torch.Tensor:
    """Per-channel log decay in fp32 (docs/kda.md §2), with `a = exp(A_log[h])` and `x = raw + dt_bias[h, :]`:
    `g = -a · softplus(x)` (Kimi-Linear), or with `lower_bound` `g = lower_bound · sigmoid(a · x)` (GLM-5.3-Flash's
    bounded gate: every log decay lies in `(lower_bound, 0)`).

    raw: `[B, T, H, K]` (output of the low-rank gate projection); A_log: `H` values (e.g. `[1, 1, H, 1]`);
    dt_bias: `H·K` values. Returns fp32 `[B, T, H, K]`, all entries < 0.
    """
    if raw.dim() != 4:
        raise ValueError(f"kda_gate: raw must be [B, T, H, K], got shape {tuple(raw.shape)}")
    num_heads, head_dim = raw.shape[-2:]
    if A_log.numel() != num_heads:
        raise ValueError(f"kda_gate: A_log must hold H={num_heads} values, got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != num_heads * head_dim:
        raise ValueError(
            f"kda_gate: dt_bias must hold H·K={num_heads * head_dim} values, got shape {tuple(dt_bias.shape)}"
        )
    decay_rate = A_log.float().reshape(num_heads, 1).exp()
    x = raw.float() + dt_bias.float().reshape(num_heads, head_dim)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(decay_rate * x)
    return -decay_rate * F.softplus(x)


def causal_short_conv(x: torch.Tensor, weight: torch.Tensor, left_context: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise conv + SiLU over a sequence (prefill).

    x: `[B, C, T]`; weight: `[C, 1, W]` (an `nn.Conv1d(groups=C)` weight); left_context: `[B, C, L]`, the inputs
    that came before `x` (a cached conv state), or None for a sequence start. Missing context counts as zeros.
    Computed in the weight's dtype; returns `[B, C, T]` in x's dtype, stored token-major (its transpose is contiguous).
    """
    batch_size, channels, _ = x.shape
    width = weight.shape[-1]
    if weight.shape != (channels, 1, width):
        raise ValueError(f"causal_short_conv: weight must be [C={channels}, 1, W], got shape {tuple(weight.shape)}")
    # Token-major `[B, T, C]` throughout (a view when x is the transpose of a token-major tensor, as the KDA layer
    # passes it): a channels-last depthwise conv2d over `[B, C, 1, T]` reads and writes that layout directly, where
    # the channel-major conv1d needs two transposing copies of the whole sequence, several times the conv's cost on
    # CPU. The W-1 context columns make the un-padded conv output exactly T columns, one per input of x.
    if left_context is None:
        context = x.new_zeros(batch_size, width - 1, channels)
    else:
        context = left_context[..., max(left_context.shape[-1] - (width - 1), 0) :].to(x.dtype).transpose(1, 2)
        context = F.pad(context, (0, 0, width - 1 - context.shape[1], 0))
    tokens = torch.cat([context, x.transpose(1, 2)], dim=1).to(weight.dtype)  # [B, W-1+T, C]
    # In the weight's dtype (fp32 weights give an fp32 conv, as GLM-5.3-Flash runs it), returned in x's dtype.
    conv = partial(F.conv2d, groups=channels)  # in fp32 on CPUs without native bf16 products (`product`)
    out = product(conv, tokens.unsqueeze(1).permute(0, 3, 1, 2), weight.unsqueeze(2))  # [B, C, 1, T]
    return F.silu(out.squeeze(2)).to(x.dtype)


def causal_short_conv_step(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """Decode steps of `causal_short_conv`: x `[B, C, T]` (T = 1 in decoding), weight `[C, 1, W]`, conv_state
    `[B, C, L]` with L >= W-1 (the previous inputs, newest last). Returns `[B, C, T]`: each token's output computed
    by the ops of a one-token step on a `[B, C, W]` window (the W products in the weight's dtype, then their sum), so
    it has a decode step's bits whatever T is (a sum over a longer tensor may add in another order)."""
    width = weight.shape[-1]
    if x.dim() != 3 or x.shape[-1] < 1 or conv_state.shape[-1] < width - 1:
        raise ValueError(
            f"causal_short_conv_step: x must be [B, C, T >= 1] and conv_state [B, C, >= {width - 1}], got shapes "
            f"{tuple(x.shape)} and {tuple(conv_state.shape)}"
        )
    inputs = torch.cat([conv_state[..., conv_state.shape[-1] - (width - 1) :].to(x.dtype), x], dim=-1)
    steps = [_short_conv_window(inputs[..., t : t + width].contiguous(), weight) for t in range(x.shape[-1])]
    return steps[0] if len(steps) == 1 else torch.cat(steps, dim=-1)


def _short_conv_window(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token's conv + SiLU from its contiguous window `[B, C, W]` (oldest input first): `[B, C, 1]`."""
    return F.silu((window.to(weight.dtype) * weight[:, 0]).sum(dim=-1, keepdim=True)).to(window.dtype)


def _check_kda_inputs(q, k, v, g, beta, initial_state) -> None:
    """Raise a ValueError naming the first tensor whose shape does not fit `q: [B, T, H, K]`."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    batch_size, seq_len, num_heads, head_k_dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must match q {tuple(q.shape)} ([B, T, H, K]), got shape {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must match q {tuple(q.shape)} ([B, T, H, K]), got shape {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B={batch_size}, T={seq_len}, H={num_heads}, V], got shape {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}, got shape {tuple(beta.shape)}")
    state_shape = (batch_size, num_heads, head_k_dim, v.shape[-1])
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state must be [B, H, K, V] = {state_shape}, got shape {tuple(initial_state.shape)}")


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA (docs/kda.md §3), the decode path.

    `S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ (scale·q_t)`.
    q, k: `[B, T, H, K]`, L2-normalised by the caller; v: `[B, T, H, V]`; g: `[B, T, H, K]`; beta: `[B, T, H]`;
    initial_state: `[B, H, K, V]` (not modified); scale defaults to `K ** -0.5`.
    Returns `o: [B, T, H, V]` in `v.dtype` and the fp32 final state `[B, H, K, V]` (or None).
    """
    _check_kda_inputs(q, k, v, g, beta, initial_state)
    batch_size, seq_len, num_heads, head_k_dim = q.shape
    head_v_dim = v.shape[-1]
    if scale is None:
        scale = head_k_dim**-0.5
    out_dtype = v.dtype
    q, k, v, beta = q.float() * scale, k.float(), v.float(), beta.float()
    decay = g.float().exp()
    if initial_state is None:
        state = q.new_zeros(batch_size, num_heads, head_k_dim, head_v_dim)
    else:
        state = initial_state.float()
    # Shaped once for the per-step products over all heads (rows [.., 1, K], columns [.., K, 1]), so that a step
    # (a decode step: T = 1) is a handful of batched ops.
    k_rows, k_cols, q_rows = k.unsqueeze(-2), k.unsqueeze(-1), q.unsqueeze(-2)  # [B, T, H, 1, K] / [B, T, H, K, 1]
    decay, v, beta = decay.unsqueeze(-1), v.unsqueeze(-2), beta[..., None, None]  # [B,T,H,K,1], [B,T,H,1,V], [..,1,1]
    outputs = []
    for t in range(seq_len):
        state = state * decay[:, t]
        # Delta rule: move the state's prediction for k_t (kᵀS) a fraction beta towards v_t.
        delta = beta[:, t] * (v[:, t] - k_rows[:, t] @ state)  # [B, H, 1, V]
        state = state + k_cols[:, t] * delta
        outputs.append(q_rows[:, t] @ state)  # [B, H, 1, V]
    o = torch.cat(outputs, dim=-2).transpose(1, 2).to(out_dtype)
    return o, (state if output_final_state else None)


# Secondary chunking inside a chunk: pairwise decays only within 4-token sub-chunks, matmuls across them. The
# pairwise `[SUB, SUB, K]` work per token grows with SUB, the cross-sub-chunk factors `[C / SUB, C, K]` per token with
# C / SUB (docs/kda.md §5).
SUB_CHUNK_SIZE = 4


# Floor of the log decays that reach `exp`: below about -87 fp32 `exp` leaves its vectorised path (10-30x slower per
# element on CPU) for results under 1e-38. exp(-60) < 1e-26 is far below the rounding of every term it joins.
MIN_LOG_DECAY = -60.0


def recurrent_kda_stepwise(q: torch.Tensor, v: torch.Tensor) -> bool:
    """`kda_recurrent_stepwise` of the torch reference: False. One T-token call of `recurrent_kda` runs its batched ops
    over strided per-token slices, which take other matmul kernels and can round differently from T one-token calls;
    so a verification runs the chunked form and a replay steps token by token (cache.py)."""
    return False


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """`exp(clamp(log_decay, MIN_LOG_DECAY, 0))`: a decay factor in (0, 1]. The upper clamp turns the positive
    exponents of masked (acausal) pairs into 1, finite in the forward and backward, instead of masking them to
    `-inf` (whose `exp` is also off the fast path); callers discard those entries."""
    return log_decay.clamp(MIN_LOG_DECAY, 0.0).exp_()


def _intra_chunk_scores(q: torch.Tensor, k: torch.Tensor, cum_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed dot products inside one chunk (docs/kda.md §5, "secondary chunking").

    q, k, cum_g: `[X, C, K]` (X = batch · heads), cum_g the chunk-local cumulative log decay G. Returns
    `(A_qk, A_kk)`, both `[X, C, C]`, with `A_xk[i, j] = Σ_d x_i[d] k_j[d] exp(G_i[d] − G_j[d])` for j <= i;
    `A_qk` is 0 above the diagonal, `A_kk` holds arbitrary finite values there (its solver reads only the strict
    lower triangle).

    Each exponent must stay <= 0 (a positive one overflows fp32 for strong gates). Inside a sub-chunk the pairwise
    differences are clamped to <= 0 (the acausal ones are discarded). Across sub-chunks the decay is split at the
    anchor `r`, the first position of the row's sub-chunk: `exp(G_i − G_j) = exp(G_i − G_r) · exp(G_r − G_j)` with
    j < r <= i, so both factors are <= 1 and the block is a plain matmul. q and k are stacked as the two rows `x` of
    one product; exp runs in place on fresh temporaries, never on a tensor autograd keeps.
    """
    rows, chunk_size, head_k_dim = k.shape
    num_sub = chunk_size // SUB_CHUNK_SIZE
    sub_shape = (rows, num_sub, SUB_CHUNK_SIZE, head_k_dim)
    k_sub, g_sub = k.reshape(sub_shape), cum_g.reshape(sub_shape)
    x_sub = torch.stack([q.reshape(sub_shape), k_sub], dim=2)  # [X, NS, 2, SUB, K]: rows of A_qk and A_kk
    anchor = g_sub[..., :1, :]  # [X, NS, 1, K]

    # Blocks left of the diagonal: rows of sub-chunk a against every column j of an earlier sub-chunk (the columns
    # from the anchor on get factor 1: the diagonal block is overwritten below, the rest discarded).
    right = _decay(anchor - cum_g.unsqueeze(1))  # [X, NS, C, K]: exp(G_r − G_j)
    k_right = (right * k.unsqueeze(1)).transpose(-1, -2)  # [X, NS, K, C]
    x_left = x_sub.mul(_decay(g_sub - anchor).unsqueeze(2)).view(rows, num_sub, 2 * SUB_CHUNK_SIZE, head_k_dim)
    scores = (x_left @ k_right).view(rows, num_sub, 2, SUB_CHUNK_SIZE, chunk_size)  # [X, NS, 2, SUB, C]

    # Diagonal blocks: pairwise decays times k_j, [X, NS, SUB(i)·SUB(j), K], against every row x_(t, i') of the
    # sub-chunk in one matmul, keeping the i' = i entries: SUB times the products of a batch of per-row matrix-vector
    # products, but one large matmul, about twice as fast on CPU.
    k_decayed = _decay(g_sub.unsqueeze(-2) - g_sub.unsqueeze(-3)) * k_sub.unsqueeze(-3)  # not in place: exp's output
    pairs = k_decayed.view(rows, num_sub, SUB_CHUNK_SIZE * SUB_CHUNK_SIZE, head_k_dim)
    all_rows = x_sub.view(rows, num_sub, 2 * SUB_CHUNK_SIZE, head_k_dim) @ pairs.transpose(-1, -2)
    shape = (rows, num_sub, 2, SUB_CHUNK_SIZE, SUB_CHUNK_SIZE, SUB_CHUNK_SIZE)
    diagonal = torch.diagonal(all_rows.view(shape), dim1=3, dim2=4)  # [X, NS, 2, SUB(j), SUB(i)]
    blocks = scores.view(rows, num_sub, 2, SUB_CHUNK_SIZE, num_sub, SUB_CHUNK_SIZE)
    torch.diagonal(blocks, dim1=1, dim2=4).copy_(diagonal.permute(0, 2, 4, 3, 1))  # [X, 2, SUB(i), SUB(j), NS]
    scores = scores.transpose(1, 2).reshape(rows, 2, chunk_size, chunk_size)
    return scores[:, 0].tril(), scores[:, 1]


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size: int = 32):
    """Chunk-parallel KDA in the WY/UT form (docs/kda.md §5), the prefill path. Same contract as
    `recurrent_kda`; any T (the last chunk is padded with identity steps: k = v = 0, beta = 0, g = 0).
    The default is 32 tokens per chunk (docs/kda.md §5: the triangular solve and the cross-sub-chunk factors grow
    with the chunk, the sequential state updates, and their rounding, with the number of chunks). chunk_size must be
    a multiple of `SUB_CHUNK_SIZE` (4, the sub-chunk size of `_intra_chunk_scores`).

    Per chunk, with `G` the chunk-local cumulative log decay and `S0` the state entering the chunk, the corrected
    values `U` (what each token writes into the state) solve the unit lower-triangular system
    `(I + StrictTril(Diag(β) Akk)) U = Diag(β) (V − (K ⊙ exp G) S0)`. Then `O = (Q ⊙ exp G) S0 + Aqk U` and
    `S_end = Diag(exp G_C) S0 + (K ⊙ exp(G_C − G))ᵀ U`. Every exponent is <= 0. Chunks run sequentially, so memory
    holds one chunk's intermediates at a time, never a `[T, T]` tensor.
    """
    _check_kda_inputs(q, k, v, g, beta, initial_state)
    if chunk_size <= 0 or chunk_size % SUB_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB_CHUNK_SIZE}, got {chunk_size}")
    batch_size, seq_len, num_heads, head_k_dim = q.shape
    head_v_dim = v.shape[-1]
    if scale is None:
        scale = head_k_dim**-0.5
    out_dtype = v.dtype
    num_chunks = -(-seq_len // chunk_size)
    pad = num_chunks * chunk_size - seq_len
    rows = batch_size * num_heads

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        """`[B, T, H, D]` -> fp32 `[N, B·H, C, D]` (each chunk contiguous), zero-padded at the end (zeros are
        identity steps)."""
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad)).view(batch_size, num_chunks, chunk_size, num_heads, -1)
        return x.permute(1, 0, 3, 2, 4).reshape(num_chunks, rows, chunk_size, x.shape[-1])

    q, k, v, g = to_chunks(q) * scale, to_chunks(k), to_chunks(v), to_chunks(g)
    beta = to_chunks(beta.unsqueeze(-1))  # [N, B·H, C, 1]
    cum_g = g.cumsum(dim=-2)  # chunk-local cumulative log decay G: <= 0, decreasing along C

    if initial_state is None:
        state = q.new_zeros(rows, head_k_dim, head_v_dim)
    else:
        state = initial_state.float().reshape(rows, head_k_dim, head_v_dim)
    o = q.new_empty(num_chunks, rows, chunk_size, head_v_dim)
    for n in range(num_chunks):
        q_c, k_c, v_c, G, beta_c = q[n], k[n], v[n], cum_g[n], beta[n]
        A_qk, A_kk = _intra_chunk_scores(q_c, k_c, G)
        # UT transform: [W | U~] = (I + StrictTril(Diag(β) Akk))⁻¹ Diag(β) [K ⊙ exp G | V]. The solver reads
        # only the strict lower triangle (unit diagonal). Solved transposed, [W | U~]ᵀ (I + ...)ᵀ = (...)ᵀ, which
        # takes our row-major operands as LAPACK's column-major ones: about 3x faster than the direct form on CPU.
        exp_g = _decay(G)
        rhs = beta_c * torch.cat([k_c * exp_g, v_c], dim=-1)
        wu = torch.linalg.solve_triangular(
            (beta_c * A_kk).transpose(-1, -2), rhs.transpose(-1, -2), upper=True, left=False, unitriangular=True
        )
        w, u = wu.transpose(-1, -2).split([head_k_dim, head_v_dim], dim=-1)
        u = torch.baddbmm(u, w, state, alpha=-1)  # corrected values: remove what S0 already predicts
        o[n] = torch.baddbmm((q_c * exp_g) @ state, A_qk, u)
        G_last = G[:, -1:, :]  # [B·H, 1, K]
        state = torch.baddbmm(state * _decay(G_last.transpose(-1, -2)), (k_c * _decay(G_last - G)).transpose(-1, -2), u)

    o = o.view(num_chunks, batch_size, num_heads, chunk_size, head_v_dim).permute(1, 0, 3, 2, 4)
    o = o.reshape(batch_size, num_chunks * chunk_size, num_heads, head_v_dim)[:, :seq_len]
    final_state = state.view(batch_size, num_heads, head_k_dim, head_v_dim) if output_final_state else None
    return o.to(out_dtype), final_state
