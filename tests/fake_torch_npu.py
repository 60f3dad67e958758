"""A CPU stand-in for the torch_npu ops the npu backend calls, written from their public docs, not from our kernels.

Sources (Ascend/op-plugin, docs/zh/custom_APIs/torch_npu/): `torch_npu-npu_lightning_indexer.md`,
`torch_npu-npu_sparse_flash_attention.md` (signatures, shapes, dtypes, layouts, sparse modes, constraints), and for
what the docs leave open, vllm-project/vllm-ascend's kernels: unused indexer slots are -1
(csrc/attention/lightning_indexer/op_kernel/lightning_indexer_common.h, INVALID_IDX) and sparse attention reads at
most `ceil(threshold / sparse_block_size)` index slots, stops at the first -1 and clips blocks to the threshold
(csrc/attention/sparse_flash_attention/op_kernel/arch22/sparse_flash_attention_kernel_mla.h). Summary in
docs/backends.md §3.

Only the modes the backend uses are implemented (BSND queries, PA_BSND paged keys, no softmax statistics); any
documented constraint that is violated raises a RuntimeError naming the argument, as the real op's checks fail.
Math in fp32 over the given values. Install with `install(monkeypatch, available=True)`: it puts this module in
`sys.modules["torch_npu"]` and a `torch.npu` namespace whose `is_available()` returns `available`.
"""

import math
import sys
import types

import torch

_OP_DTYPES = (torch.bfloat16, torch.float16)
_SPARSE_COUNTS = set(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
_DEFAULT_TOKENS = 2**63 - 1

calls: list[str] = []  # names of the ops called, in order (tests check that the backend really used them)
inputs: dict[str, dict] = {}  # op name -> the tensors of its last call (tests check they are views of the cache)


def _fail(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _check_contiguous(**tensors) -> None:
    for name, tensor in tensors.items():
        _fail(tensor is None or tensor.is_contiguous(), f"{name} must be contiguous (non-contiguous is not supported)")


def _check_lengths(name: str, lengths, batch: int, upper: int) -> list[int]:
    _fail(lengths is not None, f"{name} is required with a PA_BSND key layout")
    _fail(lengths.dtype == torch.int32, f"{name} must be int32, got {lengths.dtype}")
    _fail(tuple(lengths.shape) == (batch,), f"{name} must have shape [B={batch}], got {tuple(lengths.shape)}")
    values = lengths.tolist()
    _fail(all(0 <= v <= upper for v in values), f"{name} values must lie in [0, {upper}], got {values}")
    return values


def _check_paged(name: str, pages: torch.Tensor, dtype: torch.dtype, head_dim: int) -> int:
    _fail(pages.dim() == 4, f"{name} must be [block_count, block_size, 1, D] for PA_BSND, got {tuple(pages.shape)}")
    block_size = pages.shape[1]
    _fail(pages.shape[2] == 1, f"{name}: N2 must be 1, got {pages.shape[2]}")
    _fail(pages.shape[3] == head_dim, f"{name}: D must be {head_dim}, got {pages.shape[3]}")
    _fail(block_size % 16 == 0 and block_size <= 1024, f"{name}: block_size {block_size} must be 16k, <= 1024")
    _fail(pages.dtype == dtype, f"{name} dtype {pages.dtype} must equal the query dtype {dtype}")
    return block_size


def _check_block_table(block_table, batch: int, num_blocks: int, block_size: int, lengths: list[int]) -> None:
    """int32 `[B, >= ceil(max length / block_size)]`; every block a sequence's length covers must exist."""
    _fail(block_table is not None, "block_table is required with a PA_BSND key layout")
    _fail(block_table.dtype == torch.int32, f"block_table must be int32, got {block_table.dtype}")
    _fail(block_table.dim() == 2 and block_table.shape[0] == batch, f"block_table must be [B={batch}, blocks]")
    needed = math.ceil(max(lengths) / block_size)
    _fail(block_table.shape[1] >= needed, f"block_table has {block_table.shape[1]} columns, needs >= {needed}")
    for row, length in zip(block_table.tolist(), lengths, strict=True):
        used = row[: math.ceil(length / block_size)]
        _fail(all(0 <= block < num_blocks for block in used), "block_table maps tokens to blocks that do not exist")


def _gather_tokens(pages: torch.Tensor, block_table: torch.Tensor, batch: int, positions: torch.Tensor):
    """Rows `[n, D]` (fp32) of logical positions `positions` of batch `batch`: `pages[table[b, j // bs], j % bs]`."""
    block_size = pages.shape[1]
    blocks = block_table[batch].long()[positions // block_size]
    return pages[blocks, positions % block_size, 0].float()


def npu_lightning_indexer(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    block_table=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    pre_tokens=_DEFAULT_TOKENS,
    next_tokens=_DEFAULT_TOKENS,
    return_value=False,
):
    """`Indices = Top-k_j Σ_h w[i,h]·ReLU(q[i,h]·k[j])` over the keys visible to each query. Returns
    (int32 `[B, S1, 1, sparse_count]` positions by descending score, -1 after the last visible key; values)."""
    calls.append("npu_lightning_indexer")
    inputs["npu_lightning_indexer"] = dict(key=key)
    _fail(layout_query == "BSND" and layout_key == "PA_BSND", "the fake implements layout_query=BSND, PA_BSND keys")
    _fail(query.dim() == 4, f"query must be [B, S1, N1, D], got {tuple(query.shape)}")
    batch, num_queries, num_heads, head_dim = query.shape
    _fail(query.dtype in _OP_DTYPES, f"query must be bfloat16 or float16, got {query.dtype}")
    _fail(head_dim == 128, f"query D must be 128, got {head_dim}")
    _fail(num_heads <= 64, f"query N1 must be <= 64, got {num_heads}")
    block_size = _check_paged("key", key, query.dtype, head_dim)
    _fail(tuple(weights.shape) == (batch, num_queries, num_heads), f"weights must be [B, S1, N1] = {query.shape[:3]}")
    _fail(weights.dtype in (query.dtype, torch.float32), f"weights must be fp32 or {query.dtype}, got {weights.dtype}")
    _check_contiguous(query=query, key=key, weights=weights)
    _fail(sparse_count in _SPARSE_COUNTS, f"sparse_count {sparse_count} must be in [1, 2048] or 3072..8192 by 1024")
    _fail(sparse_mode in (0, 3), f"sparse_mode must be 0 or 3, got {sparse_mode}")
    _fail(pre_tokens == _DEFAULT_TOKENS and next_tokens == _DEFAULT_TOKENS, "pre/next_tokens accept only defaults")
    _fail(not return_value, "return_value is not supported with PA_BSND keys")
    query_lengths = [num_queries] * batch
    if actual_seq_lengths_query is not None:
        query_lengths = _check_lengths("actual_seq_lengths_query", actual_seq_lengths_query, batch, num_queries)
    key_lengths = _check_lengths("actual_seq_lengths_key", actual_seq_lengths_key, batch, key.shape[0] * block_size)
    _check_block_table(block_table, batch, key.shape[0], block_size, key_lengths)

    indices = torch.full((batch, num_queries, 1, sparse_count), -1, dtype=torch.int32)
    values = torch.full((batch, num_queries, 1, sparse_count), float("-inf"))
    for b in range(batch):
        num_q, num_k = query_lengths[b], key_lengths[b]
        if num_q == 0 or num_k == 0:
            continue
        keys = _gather_tokens(key, block_table, b, torch.arange(num_k))  # [Lk, D]
        products = torch.relu(torch.einsum("ihd,jd->ihj", query[b, :num_q].float(), keys))
        scores = torch.einsum("ih,ihj->ij", weights[b, :num_q].float(), products)
        if sparse_mode == 3:  # rightDownCausal: query i sees j <= Lk - Lq + i
            limit = num_k - num_q + torch.arange(num_q)[:, None]
            scores = scores.masked_fill(torch.arange(num_k)[None, :] > limit, float("-inf"))
        k = min(sparse_count, num_k)
        top_values, top_indices = scores.topk(k, dim=-1)
        top_indices = top_indices.masked_fill(top_values == float("-inf"), -1)
        indices[b, :num_q, 0, :k] = top_indices.to(torch.int32)
        values[b, :num_q, 0, :k] = top_values
    return indices, values.to(query.dtype)


def npu_sparse_flash_attention(
    query,
    key,
    value,
    sparse_indices,
    scale_value,
    *,
    block_table=None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    query_rope=None,
    key_rope=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    pre_tokens=_DEFAULT_TOKENS,
    next_tokens=_DEFAULT_TOKENS,
    attention_mode=0,
    return_softmax_lse=False,
):
    """MLA-absorb sparse attention: per query, `softmax(scale · [q | q_rope]·[k | k_rope]ᵀ) @ value` over the selected
    tokens (index b selects `[b·blk, (b+1)·blk)`, clipped to the visible threshold). Returns (out `[B, S1, N1, 512]`
    in the query dtype, empty softmax_max, empty softmax_sum)."""
    calls.append("npu_sparse_flash_attention")
    inputs["npu_sparse_flash_attention"] = dict(key=key, value=value, key_rope=key_rope)
    _fail(layout_query == "BSND" and layout_kv == "PA_BSND", "the fake implements layout_query=BSND, PA_BSND kv")
    _fail(attention_mode == 2, f"attention_mode supports only 2 (MLA-absorb), got {attention_mode}")
    _fail(query.dim() == 4, f"query must be [B, S1, N1, D], got {tuple(query.shape)}")
    batch, num_queries, num_heads, latent_dim = query.shape
    _fail(query.dtype in _OP_DTYPES, f"query must be bfloat16 or float16, got {query.dtype}")
    _fail(latent_dim == 512, f"query D must be 512, got {latent_dim}")
    _fail(num_heads in (1, 2, 4, 8, 16, 32, 64, 128), f"query N1 must be a power of two <= 128, got {num_heads}")
    block_size = _check_paged("key", key, query.dtype, 512)
    _fail(value.shape == key.shape and value.dtype == key.dtype, "value must have the shape and dtype of key")
    _fail(query_rope is not None and key_rope is not None, "attention_mode=2 needs query_rope and key_rope")
    _fail(tuple(query_rope.shape) == (batch, num_queries, num_heads, 64), "query_rope must be [B, S1, N1, 64]")
    _fail(query_rope.dtype == query.dtype, "query_rope dtype must equal the query dtype")
    _check_paged("key_rope", key_rope, query.dtype, 64)
    _fail(key_rope.shape[:2] == key.shape[:2], "key_rope must have the blocks of key")
    _fail(sparse_indices.dtype == torch.int32, f"sparse_indices must be int32, got {sparse_indices.dtype}")
    _fail(
        sparse_indices.dim() == 4 and tuple(sparse_indices.shape[:3]) == (batch, num_queries, 1),
        f"sparse_indices must be [B, S1, 1, K], got {tuple(sparse_indices.shape)}",
    )
    _fail(sparse_indices.shape[-1] > 0, "sparse_indices must select > 0 entries")
    _check_contiguous(
        query=query, key=key, value=value, sparse_indices=sparse_indices, query_rope=query_rope, key_rope=key_rope
    )
    power_of_two = sparse_block_size > 0 and sparse_block_size & (sparse_block_size - 1) == 0
    _fail(power_of_two and sparse_block_size <= 128, "sparse_block_size must be a power of 2 <= 128")
    _fail(block_size % sparse_block_size == 0, "sparse_block_size must divide block_size")
    _fail(sparse_mode in (0, 3), f"sparse_mode must be 0 or 3, got {sparse_mode}")
    _fail(pre_tokens == _DEFAULT_TOKENS and next_tokens == _DEFAULT_TOKENS, "pre/next_tokens accept only defaults")
    _fail(not return_softmax_lse, "return_softmax_lse is not supported with PA_BSND kv")
    query_lengths = [num_queries] * batch
    if actual_seq_lengths_query is not None:
        query_lengths = _check_lengths("actual_seq_lengths_query", actual_seq_lengths_query, batch, num_queries)
    kv_lengths = _check_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, batch, key.shape[0] * block_size)
    _check_block_table(block_table, batch, key.shape[0], block_size, kv_lengths)

    out = _attend(query, query_rope, key, key_rope, value, sparse_indices, scale_value, block_table, query_lengths,
                  kv_lengths, sparse_block_size, sparse_mode)  # fmt: skip
    empty = torch.empty(0)
    return out.to(query.dtype), empty, empty


def _attend(query, query_rope, key, key_rope, value, sparse_indices, scale, block_table, query_lengths, kv_lengths,
            sparse_block_size, sparse_mode):  # fmt: skip
    """MLA-absorb attention per query over the selected tokens (fp32 `[B, S1, N1, D]`); D is value's."""
    batch, num_queries, num_heads, _ = query.shape
    out = torch.zeros(batch, num_queries, num_heads, value.shape[-1])
    num_slots = sparse_indices.shape[-1]
    for b in range(batch):
        num_q, num_kv = query_lengths[b], kv_lengths[b]
        for i in range(num_q):
            threshold = num_kv - num_q + i + 1 if sparse_mode == 3 else num_kv
            positions = []
            for slot in sparse_indices[b, i, 0, : min(num_slots, math.ceil(threshold / sparse_block_size))].tolist():
                if slot < 0:
                    break
                start = slot * sparse_block_size
                positions.extend(range(start, min(start + sparse_block_size, threshold)))
            if not positions:
                continue  # no valid token: zero output
            positions = torch.tensor(positions)
            latent = _gather_tokens(key, block_table, b, positions)  # [n, 512]
            rope = _gather_tokens(key_rope, block_table, b, positions)  # [n, 64]
            scores = query[b, i].float() @ latent.T + query_rope[b, i].float() @ rope.T  # [N1, n]
            probs = torch.softmax(scores * scale, dim=-1)
            out[b, i] = probs @ _gather_tokens(value, block_table, b, positions)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Recurrent gated delta rule (KDA decode), from Ascend/op-plugin
# docs/zh/custom_APIs/torch_npu/torch_npu-npu_recurrent_gated_delta_rule.md: per token,
# `S = S · α · Diag(αk)` (α = exp(g) per head, αk = exp(gk) per key channel: the decay acts on S's Dk axis),
# `S = S + β (v − S k) kᵀ`, `o = scale · S q`, with S `[Dv, Dk]`; the state after token i is written to
# `state[ssm_state_indices[i]]` (the tensor is input and output) and a sequence starts from the state of its
# `num_accepted_tokens`-th token's slot (default: its first). Value head h reads key head h // (Nv / Nk).

_GDR_MAX_TOKENS, _GDR_MAX_HEADS, _GDR_MAX_DIM = 8, 256, 512


def npu_recurrent_gated_delta_rule(
    query,
    key,
    value,
    state,
    *,
    beta=None,
    scale=None,
    actual_seq_lengths=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    g=None,
    gk=None,
):
    calls.append("npu_recurrent_gated_delta_rule")
    for name, tensor in (("query", query), ("key", key), ("value", value), ("state", state), ("beta", beta)):
        _fail(tensor is not None, f"{name} is required")
        _fail(tensor.dtype == torch.bfloat16, f"{name} must be bfloat16, got {tensor.dtype}")
    _fail(query.dim() == 3 and key.shape == query.shape, f"query and key must be [T, Nk, Dk], got {tuple(query.shape)}")
    tokens, key_heads, key_dim = query.shape
    _fail(value.dim() == 3 and value.shape[0] == tokens, f"value must be [T={tokens}, Nv, Dv], got {value.shape}")
    value_heads, value_dim = value.shape[1:]
    _fail(1 <= key_heads <= _GDR_MAX_HEADS and 1 <= value_heads <= _GDR_MAX_HEADS, "Nk, Nv must lie in [1, 256]")
    _fail(1 <= key_dim <= _GDR_MAX_DIM and 1 <= value_dim <= _GDR_MAX_DIM, "Dk, Dv must lie in [1, 512]")
    _fail(value_heads % key_heads == 0, f"Nv={value_heads} must be a multiple of Nk={key_heads}")
    _fail(
        state.dim() == 4 and tuple(state.shape[1:]) == (value_heads, value_dim, key_dim) and state.shape[0] >= tokens,
        f"state must be [BlockNum >= T, Nv, Dv, Dk] = [>= {tokens}, {value_heads}, {value_dim}, {key_dim}], got "
        f"{tuple(state.shape)}",
    )
    _fail(tuple(beta.shape) == (tokens, value_heads), f"beta must be [T, Nv], got {tuple(beta.shape)}")
    _fail(isinstance(scale, float), f"scale is required (a float), got {scale!r}")
    _fail(actual_seq_lengths is not None and actual_seq_lengths.dtype == torch.int32, "actual_seq_lengths: int32 [B]")
    lengths = actual_seq_lengths.tolist()
    _fail(all(1 <= n <= _GDR_MAX_TOKENS for n in lengths), f"actual_seq_lengths must lie in [1, 8], got {lengths}")
    _fail(sum(lengths) == tokens, f"actual_seq_lengths must sum to T={tokens}, got {lengths}")
    _fail(ssm_state_indices is not None and ssm_state_indices.dtype == torch.int32, "ssm_state_indices: int32 [T]")
    _fail(tuple(ssm_state_indices.shape) == (tokens,), f"ssm_state_indices must be [T={tokens}]")
    slots = ssm_state_indices.tolist()
    _fail(all(0 <= i < state.shape[0] for i in slots), "ssm_state_indices must lie in [0, BlockNum)")
    accepted = [1] * len(lengths)
    if num_accepted_tokens is not None:
        _fail(num_accepted_tokens.dtype == torch.int32, "num_accepted_tokens must be int32")
        accepted = num_accepted_tokens.tolist()
        _fail(all(1 <= a <= n for a, n in zip(accepted, lengths, strict=True)), "num_accepted_tokens in [1, L_i]")
    if g is not None:
        _fail(g.dtype == torch.float32 and tuple(g.shape) == (tokens, value_heads), "g must be float32 [T, Nv]")
    if gk is not None:
        shape = (tokens, value_heads, key_dim)
        _fail(gk.dtype == torch.float32 and tuple(gk.shape) == shape, f"gk must be float32 {list(shape)}")

    group = value_heads // key_heads
    q, k = query.float().repeat_interleave(group, dim=1), key.float().repeat_interleave(group, dim=1)
    v, b = value.float(), beta.float()
    decay = torch.ones(tokens, value_heads, 1, key_dim)
    if g is not None:
        decay = decay * g.exp()[:, :, None, None]
    if gk is not None:
        decay = decay * gk.exp()[:, :, None, :]
    out = torch.zeros(tokens, value_heads, value_dim)
    first = 0
    for length, accept in zip(lengths, accepted, strict=True):
        current = state[slots[first + accept - 1]].float()  # [Nv, Dv, Dk]
        for t in range(first, first + length):
            current = current * decay[t]
            error = v[t] - (current @ k[t, :, :, None])[..., 0]  # v − S k, [Nv, Dv]
            current = current + b[t][:, None, None] * error[:, :, None] * k[t][:, None, :]
            out[t] = scale * (current @ q[t, :, :, None])[..., 0]
            state[slots[t]] = current.to(state.dtype)
        first += length
    return out.to(torch.bfloat16)


def install(monkeypatch, available: bool = True) -> types.ModuleType:
    """Make `import torch_npu` return this module and `torch.npu.is_available()` return `available`."""
    calls.clear()
    inputs.clear()
    monkeypatch.setitem(sys.modules, "torch_npu", sys.modules[__name__])
    monkeypatch.setattr(torch, "npu", _npu_namespace(available), raising=False)
    monkeypatch.setattr(torch.Tensor, "record_stream", _record_stream)
    _reset_streams()
    return sys.modules[__name__]


# ---------------------------------------------------------------------------------------------------------------
# Streams and events (the three-stream prolog, npu_kernels.three_stream_prolog)
#
# torch_npu's stream API as torch.cuda's (Ascend/pytorch torch_npu/npu/streams.py): `torch.npu.Stream(device)`,
# `torch.npu.Event()`, `Event.record(stream)` captures the work submitted to the stream so far, `Stream.wait_event(e)`
# makes later work on the stream wait for it, `torch.npu.stream(s)` makes `s` current, `torch.npu.current_stream()`.
# The fake runs everything at once on the CPU, so it cannot show a race; it checks the discipline instead, inside
# `check_streams()`: every op is counted on the current stream (a vector clock per stream, copied by `record` and
# merged by `wait_event`), every tensor remembers the stream and count that produced it and the stream that
# allocated its storage, and an op fails with a RuntimeError when it reads
# - a tensor produced on another stream whose producing op the current stream has not waited for (a missing
#   `wait_event`), or
# - a tensor allocated on another stream that was not `record_stream`ed to this one (the caching allocator could
#   hand its memory out again while this stream still reads it; parameters are never freed and are exempt).


class Stream:
    def __init__(self, device=None, priority=0):
        self.clock = {self: 0}  # stream -> how many of its ops this stream has seen (its own: submitted)
        _streams.created += 1

    def wait_event(self, event):
        event.wait(self)


class Event:
    def __init__(self, enable_timing=False):
        self.clock = None

    def record(self, stream=None):
        self.clock = dict((stream or _streams.current).clock)

    def wait(self, stream=None):
        stream = stream or _streams.current
        for other, count in (self.clock or {}).items():  # an event never recorded: nothing to wait for
            stream.clock[other] = max(stream.clock.get(other, 0), count)


class _StreamState:
    def __init__(self):
        self.default = self.current = None
        self.created = 0

    def reset(self):
        self.created = 0
        self.default = self.current = Stream()
        self.created = 0


_streams = _StreamState()


def _reset_streams() -> None:
    _streams.reset()


def current_stream(device=None) -> Stream:
    return _streams.current


class stream:  # noqa: N801 (torch.npu.stream, a context manager)
    def __init__(self, target):
        self.target = target

    def __enter__(self):
        self.previous, _streams.current = _streams.current, self.target
        return self.target

    def __exit__(self, *exc):
        _streams.current = self.previous


def _record_stream(tensor, target) -> None:
    with torch._C.DisableTorchFunction():  # bookkeeping, not an op
        base = tensor if tensor._base is None else tensor._base
        base._fake_recorded = getattr(base, "_fake_recorded", set()) | {target}


def _check_read(tensor, current) -> None:
    if isinstance(tensor, torch.nn.Parameter):
        return
    producer = getattr(tensor, "_fake_produced", None)
    if producer is not None and producer[0] is not current and current.clock.get(producer[0], 0) < producer[1]:
        raise RuntimeError("a tensor produced on another stream is read without waiting for it (wait_event missing)")
    base = tensor if tensor._base is None else tensor._base
    allocator = getattr(base, "_fake_allocated", _streams.default)
    if allocator is not current and current not in getattr(base, "_fake_recorded", ()):
        raise RuntimeError("a tensor allocated on another stream is used without record_stream on this one")


_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"}


class _StreamChecker(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # metadata (shape, dtype, ...): no data read
            return func(*args, **kwargs)
        current = _streams.current
        inputs = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        for tensor in inputs:
            _check_read(tensor, current)
        result = func(*args, **kwargs)
        current.clock[current] += 1
        stamp = (current, current.clock[current])
        in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS
        written = [args[0]] if inputs and in_place else []
        for tensor in torch.utils._pytree.tree_leaves(result):
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter):
                if tensor._base is None and not hasattr(tensor, "_fake_allocated"):
                    tensor._fake_allocated = current
                    tensor._fake_produced = stamp
                elif tensor._base is not None:  # a view: its data is its base's
                    source = getattr(tensor._base, "_fake_produced", None)
                    if source is not None:
                        tensor._fake_produced = source
        for tensor in written:  # an in-place op writes its first argument (and the storage under it)
            if isinstance(tensor, torch.Tensor):
                tensor._fake_produced = stamp
                if tensor._base is not None:
                    tensor._base._fake_produced = stamp
        return result


def check_streams():
    """Context manager: check the stream discipline of every torch op run inside it (section doc)."""
    return _StreamChecker()


def _npu_namespace(available: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        is_available=lambda: available,
        Stream=Stream,
        Event=Event,
        current_stream=current_stream,
        stream=stream,
    )


# ---------------------------------------------------------------------------------------------------------------
# KV-quant sparse attention (Ascend/op-plugin docs/zh/custom_APIs/torch_npu/
# torch_npu-npu_kv_quant_sparse_flash_attention.md): the SFA contract with a quantized key = value whose rows pack
# `[512 quantized nope | 64 RoPE values in the query dtype | 4 fp32 per-tile dequant scales]` (KV_D = 656 =
# 512 + 64·2 + 4·4), query = `[q_nope | q_rope]` (Q_D = 576), key/value_quant_mode 2 (per tile), tile_size 128,
# rope_head_dim 64, quant_scale_repo_mode 1 (scales stored with the data), key_dequant_scale only its default. Key
# dtypes int8 (A2/A3) or float8_e4m3fn (950, where sparse_block_size is 1 only). Dequantization `element · scale`
# per tile (the doc writes `Dequant(K, Scale_K)`). Output D = 512 (vllm-ascend's infershape of the op; the doc says
# "the query's shape").


def npu_kv_quant_sparse_flash_attention(
    query,
    key,
    value,
    sparse_indices,
    scale_value,
    key_quant_mode,
    value_quant_mode,
    *,
    key_dequant_scale=None,
    value_dequant_scale=None,
    block_table=None,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    pre_tokens=_DEFAULT_TOKENS,
    next_tokens=_DEFAULT_TOKENS,
    attention_mode=0,
    quant_scale_repo_mode=1,
    tile_size=128,
    rope_head_dim=64,
    key_dtype=None,
    value_dtype=None,
):
    calls.append("npu_kv_quant_sparse_flash_attention")
    inputs["npu_kv_quant_sparse_flash_attention"] = dict(key=key, value=value)
    _fail(layout_query == "BSND" and layout_kv == "PA_BSND", "the fake implements layout_query=BSND, PA_BSND kv")
    _fail(attention_mode == 2, f"attention_mode supports only 2 (MLA-absorb), got {attention_mode}")
    _fail(key_quant_mode == 2 and value_quant_mode == 2, "key_quant_mode and value_quant_mode support only 2")
    _fail(quant_scale_repo_mode == 1, "quant_scale_repo_mode supports only 1 (combine)")
    _fail(tile_size == 128 and rope_head_dim == 64, "tile_size supports only 128, rope_head_dim only 64")
    _fail(key_dequant_scale is None and value_dequant_scale is None, "key/value_dequant_scale: reserved, default only")
    _fail(query.dim() == 4 and query.shape[-1] == 576, f"query must be [B, S1, N1, 576], got {tuple(query.shape)}")
    _fail(query.dtype in _OP_DTYPES, f"query must be bfloat16 or float16, got {query.dtype}")
    batch, num_queries, num_heads, _ = query.shape
    _fail(
        num_heads in (1, 2, 4, 8, 16, 32, 48, 64, 128), f"query N must be in 1..128 (powers of 2, 48), got {num_heads}"
    )
    _fail(key.dtype in (torch.int8, torch.float8_e4m3fn), f"key must be int8 or float8_e4m3fn, got {key.dtype}")
    _fail(key.dim() == 4 and key.shape[2] == 1 and key.shape[3] == 656, "key must be [blocks, block_size, 1, 656]")
    block_size = key.shape[1]
    _fail(block_size % 16 == 0 and block_size <= 1024, f"key: block_size {block_size} must be 16k, <= 1024")
    _fail(value.shape == key.shape and value.dtype == key.dtype, "value must have the shape and dtype of key")
    _check_contiguous(query=query, sparse_indices=sparse_indices)  # key: axis 0 may be strided on the 950
    _fail(key[0].is_contiguous(), "key must be contiguous within a block")
    _fail(sparse_indices.dtype == torch.int32, f"sparse_indices must be int32, got {sparse_indices.dtype}")
    _fail(
        sparse_indices.dim() == 4 and tuple(sparse_indices.shape[:3]) == (batch, num_queries, 1),
        f"sparse_indices must be [B, S1, 1, K], got {tuple(sparse_indices.shape)}",
    )
    if key.dtype == torch.float8_e4m3fn:
        _fail(sparse_block_size == 1, "sparse_block_size supports only 1 with float8_e4m3fn keys (950)")
    else:
        power_of_two = sparse_block_size > 0 and sparse_block_size & (sparse_block_size - 1) == 0
        _fail(power_of_two and sparse_block_size <= 16, "sparse_block_size must be a power of 2 in [1, 16] (A2/A3)")
    _fail(block_size % sparse_block_size == 0, "sparse_block_size must divide block_size")
    _fail(sparse_mode in (0, 3), f"sparse_mode must be 0 or 3, got {sparse_mode}")
    _fail(pre_tokens == _DEFAULT_TOKENS and next_tokens == _DEFAULT_TOKENS, "pre/next_tokens accept only defaults")
    query_lengths = [num_queries] * batch
    if actual_seq_lengths_query is not None:
        query_lengths = _check_lengths("actual_seq_lengths_query", actual_seq_lengths_query, batch, num_queries)
    kv_lengths = _check_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, batch, key.shape[0] * block_size)
    _check_block_table(block_table, batch, key.shape[0], block_size, kv_lengths)

    packed = key.contiguous().view(torch.uint8)  # [blocks, block_size, 1, 656] bytes
    nope = packed[..., :512].view(key.dtype).float()
    rope = packed[..., 512:640].view(query.dtype).float()
    scales = packed[..., 640:].view(torch.float32)  # [blocks, block_size, 1, 4]
    latent = nope * scales.repeat_interleave(128, dim=-1)
    out = _attend(query[..., :512], query[..., 512:], latent, rope, latent, sparse_indices, scale_value, block_table,
                  query_lengths, kv_lengths, sparse_block_size, sparse_mode)  # fmt: skip
    return out.to(query.dtype)
