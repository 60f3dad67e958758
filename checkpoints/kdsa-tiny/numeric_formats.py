"""Numeric formats the KDSA cache uses at run time: MXFP8 (indexer keys and queries) and FP8 E4M3 with fp32
power-of-two tile scales (MLA latent cache). docs/design.md §4; docs/quantization.md §1-§2.

They live here, with the kernels, because `KDSACache` needs them in any copy of the model files (remote code);
`quantization/` (the HF quantizer and its config) builds on them.

**MXFP8** (OCP Microscaling Formats v1.0, §5 and §6.3): blocks of `MX_BLOCK_SIZE` = 32 consecutive elements of the
last dim share one E8M0 scale `X = 2^e` (byte `e + 127`, `e` in [-127, 127]; byte 0xFF = NaN); elements are FP8 E4M3
(`float8_e4m3fn`: max 448, largest exponent `emax = 8`, no Inf). Element `P_i = saturate_RNE(V_i / X)`, value
`P_i · X`. Two scale rules, both computed from the bits of the fp32 block maximum, never from fp32 `log2` (which
rounds: docs/quantization.md §1):
- `"floor"` — the spec's rule: `e = floor(log2(amax)) - emax`. `amax / X` lies in [256, 512), so block maxima in
  (448, 512)·X clip to 448 (up to 12.5 % error on the block maximum).
- `"ceil"` (default) — the non-clipping rule of cuBLAS MX "RCEIL" and DeepSeek's ue8m0 scales: the smallest `X`
  with `amax <= 448 · X`, i.e. `e = ceil(log2(amax / 448))` evaluated exactly. Default because it never saturates
  (the scaled maximum lies in (224, 448]) and it is what the hardware recipes that produce MXFP8 data use.
Special values, as the spec says: an all-zero block (or any `amax < 2^-118` under floor) takes the smallest scale
2^-127 (byte 0) and its elements are exact multiples of it down to E4M3's subnormals; a block holding NaN or ±Inf
gets scale byte 0xFF (NaN) and dequantizes to NaN as a whole (its stored elements carry no meaning; they are 0).

**FP8 tiles** (DeepSeek-V3.2 `act_quant` with `scale_fmt="ue8m0"`, FlashMLA's FP8 KV cache): each tile of
`FP8_TILE_SIZE` = 128 consecutive elements of the last dim — so per token, per head, per 128-wide tile for a
`[..., heads, 128·n]` tensor — gets an fp32 scale that is a power of two, `s = 2^ceil(log2(max(amax, 1e-4) / 448))`
evaluated exactly as the "ceil" rule above (the 1e-4 floor is DeepSeek's: an all-zero tile gets s = 2^-22, not 0,
so nothing divides by zero). Power-of-two scales stay exact when a kernel converts them to E8M0 (docs/quantization.md
§2). A tile holding NaN/Inf gets scale NaN and dequantizes to NaN.

`QuantizedRows` holds quantized rows (any leading shape, e.g. cache pages `[num_pages, page_size, ...]`); its
`dequantize` turns exactly the rows it holds back into values, so kernels gather first and dequantize only what they
read. `CacheFormats` reads the per-module choices from `config.quantization_config` (quant_method "kdsa").
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E4M3_EMAX = 8  # exponent of 448 = 1.75 · 2^8: the spec's emax_elem
MX_BLOCK_SIZE = 32  # OCP MX block
FP8_TILE_SIZE = 128  # DeepSeek / FlashMLA tile
FP8_AMAX_FLOOR = 1e-4  # DeepSeek's amax floor for FP8 tile scales
E8M0_BIAS = 127
E8M0_NAN = 255
MX_SCALE_RULES = ("ceil", "floor")

_MANTISSA_BITS = 23
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_MANTISSA_1_75 = 0x600000  # fp32 mantissa field of 1.75 (= 448 / 2^8)


def _check_blocks(x: torch.Tensor, block_size: int, name: str) -> None:
    if x.dim() == 0 or x.shape[-1] % block_size != 0:
        raise ValueError(
            f"{name} quantizes blocks of {block_size} elements along the last dim, which must be a multiple of "
            f"{block_size}; got shape {tuple(x.shape)}"
        )


def _block_amax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 `[..., K / block_size, 1]` block maxima of |x|; NaN if the block holds a NaN (amax would drop it)."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    return torch.where(blocks.isnan().any(dim=-1, keepdim=True), float("nan"), amax)


def _floor_log2(amax: torch.Tensor) -> torch.Tensor:
    """`floor(log2(a))` of finite fp32 `a >= 0` from its exponent field (int32). Zero and fp32 subnormals give -127;
    every caller clamps to E8M0's -127 anyway, where these all land."""
    return ((amax.view(torch.int32) >> _MANTISSA_BITS) & 0xFF) - E8M0_BIAS


def _ceil_log2_over_max(amax: torch.Tensor) -> torch.Tensor:
    """Exact `ceil(log2(a / 448))` of finite fp32 `a > 0` (int32): with `a = m · 2^E`, m in [1, 2), `a / 448 = (m /
    1.75) · 2^(E - 8)` and `m / 1.75` lies in (0.57, 1.15): the result is `E - 8`, plus 1 when `m > 1.75`. No fp32
    division, so no rounding (fp32 `amax / 448` can round down onto a power of two and give a scale one power low)."""
    bits = amax.view(torch.int32)
    return _floor_log2(amax) - E4M3_EMAX + ((bits & _MANTISSA_MASK) > _MANTISSA_1_75).int()


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """Exact fp32 `2^exponent` for int32 exponents in [-127, 127] (2^-127 is an fp32 subnormal), built from bits."""
    normal = ((exponent + E8M0_BIAS).clamp(min=1) << _MANTISSA_BITS).view(torch.float32)
    return torch.where(exponent == -E8M0_BIAS, torch.tensor(2.0**-127), normal)


def _to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even cast (spec §6.3): clamp to ±448 first (NaN stays NaN)."""
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (`float8_e8m0fnu` or their uint8 bytes) → exact fp32 `2^(byte - 127)`, NaN for byte 0xFF."""
    biased = scales.view(torch.uint8).int()
    return torch.where(biased == E8M0_NAN, float("nan"), _power_of_two(biased - E8M0_BIAS))


# ------------------------------------------------------------------------------------------------------ MXFP8


def mxfp8_quantize(
    x: torch.Tensor, scale_rule: str = "ceil", block_size: int = MX_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (E4M3 elements, E8M0 scale per `block_size` elements of the last dim) per the rules in the module doc.

    x: `[..., K]`, any float dtype, K a multiple of `block_size`. Returns `elements` float8_e4m3fn `[..., K]` and
    `scales` float8_e8m0fnu `[..., K / block_size]`.
    """
    _check_blocks(x, block_size, "MXFP8")
    if scale_rule not in MX_SCALE_RULES:
        raise ValueError(f"mxfp8 scale_rule must be one of {MX_SCALE_RULES}, got {scale_rule!r}")
    amax = _block_amax(x, block_size)
    finite = torch.isfinite(amax)
    safe_amax = torch.where(finite, amax, 0.0)
    if scale_rule == "floor":
        exponent = _floor_log2(safe_amax) - E4M3_EMAX
    else:
        exponent = _ceil_log2_over_max(safe_amax)
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)  # finite fp32 never exceeds 127 here: only the low end clamps
    # Multiply by 2^-e (exact: a power of two) rather than divide by the scale.
    scaled = x.float().reshape(amax.shape[:-1] + (block_size,)) * _power_of_two(-exponent)
    elements = _to_e4m3(torch.where(finite, scaled, 0.0)).reshape(x.shape)
    biased = torch.where(finite, exponent + E8M0_BIAS, E8M0_NAN).squeeze(-1)
    return elements, biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def mxfp8_dequantize(elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values `P_i · X` (fp32 product, exact, then cast to `dtype`). elements `[..., K]` float8_e4m3fn, scales
    `[..., K / block]` float8_e8m0fnu. A NaN scale makes its whole block NaN."""
    return dequantize_blocks(elements, e8m0_to_float(scales), dtype)


# ------------------------------------------------------------------------------------------------------ MXFP4

# OCP MX FP4 (E2M1) magnitudes of codes 0-7; bit 3 of a code is the sign (docs/kimi-k3.md §4).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_EMAX = 2  # exponent of 6 = 1.5 · 2^2: the spec's emax_elem


def mxfp4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 codes two per byte (`uint8 [..., K/2]`, the low nibble holds the even column) → fp32 values `[..., K]`
    (exact; code 8 is -0.0)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"MXFP4 packed codes must be uint8, got {packed.dtype}")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    magnitude = table[(codes & 0x07).long()]
    return torch.where((codes & 0x08).bool(), -magnitude, magnitude)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 (compressed-tensors `mxfp4-pack-quantized`): packed codes `uint8 [..., K/2]`, E8M0 scale bytes `uint8
    [..., K/32]` → values `[..., K]` in `dtype`: the fp32 product `E2M1 · 2^(byte - 127)` (exact), then one cast.
    Scale byte 0xFF is NaN (the spec's), so its whole group is NaN."""
    if scales.dtype != torch.uint8 or scales.shape[-1] * MX_BLOCK_SIZE != 2 * packed.shape[-1]:
        raise ValueError(
            f"MXFP4 scales must be uint8 [..., K/{MX_BLOCK_SIZE}] for packed codes [..., K/2]; got {scales.dtype} "
            f"{tuple(scales.shape)} for {tuple(packed.shape)}"
        )
    return dequantize_blocks(mxfp4_unpack(packed), e8m0_to_float(scales), dtype)


def mxfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's MXFP4 quantization (OCP MX v1.0 §6.3) of `x [..., K]`: per 32 elements `e = floor(log2(amax)) - 2`,
    elements `saturate_RNE(x / 2^e)` on the E2M1 grid. Returns packed codes `uint8 [..., K/2]` and scale bytes `uint8
    [..., K/32]`. KDSA never calls it on loaded weights (they stay as stored); it initialises fresh MXFP4 experts and
    builds test checkpoints."""
    _check_blocks(x, MX_BLOCK_SIZE, "MXFP4")
    amax = _block_amax(x, MX_BLOCK_SIZE)
    finite = torch.isfinite(amax)
    exponent = (_floor_log2(torch.where(finite, amax, 0.0)) - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = x.float().reshape(amax.shape[:-1] + (MX_BLOCK_SIZE,)) * _power_of_two(-exponent)
    scaled = torch.where(finite, scaled, 0.0).reshape(x.shape)
    table = torch.tensor(E2M1_VALUES, device=x.device)
    midpoints = (table[1:] + table[:-1]) / 2
    magnitude = scaled.abs().clamp(max=E2M1_VALUES[-1])
    code = torch.bucketize(magnitude, midpoints)  # a tie goes to the lower code ...
    tie_up = (code < len(midpoints)) & (magnitude == midpoints[code.clamp(max=len(midpoints) - 1)]) & (code % 2 == 1)
    code = code + tie_up.long()  # ... unless that code is odd: round half to even
    code = code | ((scaled < 0).long() << 3)
    pairs = code.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    biased = torch.where(finite, exponent + E8M0_BIAS, E8M0_NAN).squeeze(-1).to(torch.uint8)
    return packed, biased


# ---------------------------------------------------------------------------------------------- FP8 tile-128


def fp8_tile_quantize(x: torch.Tensor, tile_size: int = FP8_TILE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with one fp32 power-of-two scale per `tile_size` elements of the last dim (module doc).

    x: `[..., K]`, K a multiple of `tile_size`. Returns `elements` float8_e4m3fn `[..., K]` and `scales` fp32
    `[..., K / tile_size]` (2^-22 .. 2^120, NaN for a tile holding NaN/Inf).
    """
    _check_blocks(x, tile_size, "FP8 tile")
    amax = _block_amax(x, tile_size)
    finite = torch.isfinite(amax)
    exponent = _ceil_log2_over_max(torch.where(finite, amax, 0.0).clamp(min=FP8_AMAX_FLOOR))
    scaled = x.float().reshape(amax.shape[:-1] + (tile_size,)) * _power_of_two(-exponent)
    elements = _to_e4m3(torch.where(finite, scaled, 0.0)).reshape(x.shape)
    scales = torch.where(finite, _power_of_two(exponent), float("nan")).squeeze(-1)
    return elements, scales


def fp8_tile_dequantize(elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Values `P_i · s` in `dtype`. elements `[..., K]` float8_e4m3fn, scales fp32 `[..., K / tile]`."""
    return dequantize_blocks(elements, scales, dtype)


def dequantize_blocks(elements: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`elements · scales` per block (block = K / number of scales): E4M3 `[..., K]`, scales `[..., K / block]` —
    fp32 values, or E8M0 bytes (float8_e8m0fnu), decoded exactly. The product is exact in fp32."""
    if scales.dtype == torch.float8_e8m0fnu:
        scales = e8m0_to_float(scales)
    num_blocks = scales.shape[-1]
    blocks = elements.float().reshape(*scales.shape, elements.shape[-1] // num_blocks) * scales[..., None]
    return blocks.reshape(elements.shape).to(dtype)


# ------------------------------------------------------------------------------------ quantized rows / pages


class QuantizedRows(NamedTuple):
    """Rows `[..., W]` stored as `[elements | unquantized]`: the first Q columns quantized, the last W - Q kept as
    they are (the MLA cache's RoPE part, docs/quantization.md §2; empty for indexer keys).

    elements: float8_e4m3fn `[..., Q]`; scales: `[..., Q / block]`, float8_e8m0fnu (MXFP8) or fp32 (FP8 tiles);
    unquantized: `[..., W - Q]` in the model dtype. Leading dims are free: `[num_pages, page_size]` for cache pages,
    `[n]` for gathered rows.
    """

    elements: torch.Tensor
    scales: torch.Tensor
    unquantized: torch.Tensor

    @property
    def width(self) -> int:
        return self.elements.shape[-1] + self.unquantized.shape[-1]

    def map(self, function) -> "QuantizedRows":
        """The same function applied to each of the three tensors (select pages, gather rows, allocate...)."""
        return QuantizedRows(*(function(part) for part in self))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Rows `[..., W]` in `dtype`."""
        values = dequantize_blocks(self.elements, self.scales, dtype)
        return torch.cat([values, self.unquantized.to(dtype)], dim=-1) if self.unquantized.shape[-1] else values


class SplitRows(NamedTuple):
    """Model-dtype rows `[..., C + R]` kept as two planes, the latent `[..., C]` and the RoPE part `[..., R]`: the
    layout torch_npu's sparse attention reads in place (two contiguous page pools, docs/backends.md §2). The same
    interface as `QuantizedRows`, so the store and the kernels treat both alike; reading rows concatenates them."""

    latent: torch.Tensor
    rope: torch.Tensor

    @classmethod
    def split(cls, rows: torch.Tensor, latent_width: int) -> "SplitRows":
        """Contiguous planes copied from rows `[..., C + R]` (tests and scripts; the store writes its planes)."""
        return cls(rows[..., :latent_width].contiguous(), rows[..., latent_width:].contiguous())

    @property
    def width(self) -> int:
        return self.latent.shape[-1] + self.rope.shape[-1]

    def map(self, function) -> "SplitRows":
        return SplitRows(*(function(part) for part in self))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows `[..., C + R]` as stored (`dtype` is ignored, as for plain pages: nothing to dequantize)."""
        return torch.cat([self.latent, self.rope], dim=-1)


class PackedKVRows(NamedTuple):
    """FP8 latent rows (`QuantizedRows` of `kv_cache="fp8"`) packed into one byte row per token: `[E4M3 latent (C
    bytes) | RoPE part (R values of `rope_dtype`) | fp32 tile scales (4·C/tile bytes)]`, the row layout of torch_npu's
    `npu_kv_quant_sparse_flash_attention` (656 bytes for C = 512, R = 64, bf16, tile 128; docs/backends.md §2), which
    then reads the pages in place. `buffer`: uint8 `[..., row bytes]`, the one stored plane; `rows()` views its three
    parts as `QuantizedRows` (no copy). Otherwise the interface of `QuantizedRows`; `map` applies to the buffer."""

    buffer: torch.Tensor
    latent_width: int
    rope_width: int
    rope_dtype: torch.dtype

    @classmethod
    def pack(cls, rows: QuantizedRows) -> "PackedKVRows":
        parts = (rows.elements, rows.unquantized, rows.scales)
        buffer = torch.cat([part.contiguous().view(torch.uint8) for part in parts], dim=-1)
        return cls(buffer, rows.elements.shape[-1], rows.unquantized.shape[-1], rows.unquantized.dtype)

    def rows(self) -> QuantizedRows:
        """The three parts as views of the buffer."""
        rope_end = self.latent_width + self.rope_width * self.rope_dtype.itemsize
        return QuantizedRows(
            self.buffer[..., : self.latent_width].view(torch.float8_e4m3fn),
            self.buffer[..., rope_end:].view(torch.float32),
            self.buffer[..., self.latent_width : rope_end].view(self.rope_dtype),
        )

    @property
    def width(self) -> int:
        return self.latent_width + self.rope_width

    def map(self, function) -> "PackedKVRows":
        return self._replace(buffer=function(self.buffer))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows().dequantize(dtype)


def stored_planes(pages) -> tuple[torch.Tensor, ...]:
    """The tensors pages are stored in: one for model-dtype pages, three for `QuantizedRows`, two for `SplitRows`,
    the byte buffer of `PackedKVRows`."""
    if isinstance(pages, PackedKVRows):
        return (pages.buffer,)
    return tuple(pages) if isinstance(pages, (QuantizedRows, SplitRows)) else (pages,)


PLANAR_ROWS = (QuantizedRows, SplitRows, PackedKVRows)  # rows stored as several planes of the same leading shape


# ------------------------------------------------------------------------------------------- cache formats

QUANT_METHOD = "kdsa"
INDEXER_FORMATS = ("bf16", "mxfp8")
KV_CACHE_FORMATS = ("bf16", "fp8")


@dataclass(frozen=True)
class CacheFormats:
    """How a DSA layer's paged store keeps its rows (the user-facing names of `KDSAQuantizationConfig`).

    indexer: `"bf16"` (model dtype) or `"mxfp8"` — indexer keys stored MXFP8, queries quantized the same way before
    scoring. kv_cache: `"bf16"` or `"fp8"` — the normalised MLA latent stored FP8 in tiles of `kv_cache_tile_size`
    (128, DeepSeek/FlashMLA) with fp32 power-of-two scales, the RoPE part kept in the model dtype.
    mxfp8_scale_rule: `"ceil"` (default, never clips) or `"floor"` (the OCP spec's rule).
    """

    indexer: str = "bf16"
    kv_cache: str = "bf16"
    mxfp8_scale_rule: str = "ceil"
    kv_cache_tile_size: int = FP8_TILE_SIZE

    def __post_init__(self):
        for name, value, allowed in (
            ("indexer", self.indexer, INDEXER_FORMATS),
            ("kv_cache", self.kv_cache, KV_CACHE_FORMATS),
            ("mxfp8_scale_rule", self.mxfp8_scale_rule, MX_SCALE_RULES),
        ):
            if value not in allowed:
                raise ValueError(f"quantization_config.{name} must be one of {allowed}, got {value!r}")
        if not isinstance(self.kv_cache_tile_size, int) or self.kv_cache_tile_size <= 0:
            raise ValueError(
                f"quantization_config.kv_cache_tile_size must be a positive int, got {self.kv_cache_tile_size!r}"
            )

    @classmethod
    def from_config(cls, config) -> "CacheFormats":
        """The formats `config.quantization_config` asks for; all `"bf16"` without one.

        It may be the registered `KDSAQuantizationConfig` (package imported) or the plain dict that transformers
        leaves in the config when "kdsa" is not registered (remote code without the package). Both are read here,
        so a quantized checkpoint behaves the same either way — its weights are plain BF16, only the cache is
        quantized. Any other quant_method is rejected unless transformers knows it (then it quantizes weights and
        the cache stays BF16): transformers only warns and skips an unknown one, which would load a silently wrong
        model.
        """
        quantization = getattr(config, "quantization_config", None)
        if quantization is None:
            return cls()
        fields = quantization if isinstance(quantization, dict) else quantization.to_dict()
        method = fields.get("quant_method")
        method = getattr(method, "value", method)
        if method != QUANT_METHOD:
            from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

            if method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
                raise ValueError(
                    f"quantization_config has quant_method={method!r}, which is not registered with transformers: "
                    "loading would silently ignore it. Install/import the package that provides it (KDSA's own "
                    f"method is {QUANT_METHOD!r}, registered by `import modeling_kdsa`)."
                )
            return cls()
        formats = cls(
            indexer=fields.get("indexer", "bf16"),
            kv_cache=fields.get("kv_cache", "bf16"),
            mxfp8_scale_rule=fields.get("mxfp8_scale_rule", "ceil"),
            kv_cache_tile_size=fields.get("kv_cache_tile_size", FP8_TILE_SIZE),
        )
        formats.check_shapes(config)
        return formats

    def check_shapes(self, config) -> None:
        """ValueError naming the config field when the chosen blocks do not divide the cached widths."""
        if self.indexer == "mxfp8" and config.index_head_dim % MX_BLOCK_SIZE:
            raise ValueError(
                f"indexer='mxfp8' quantizes blocks of {MX_BLOCK_SIZE}: index_head_dim={config.index_head_dim} must "
                f"be a multiple of {MX_BLOCK_SIZE}"
            )
        if self.indexer != "bf16" and getattr(config, "index_kpool", 1) > 1:
            raise ValueError(
                f"indexer={self.indexer!r} cache format is not implemented for the k-pool indexer (index_kpool="
                f"{config.index_kpool}): its pooled keys are stored in the model dtype; use indexer='bf16'"
            )
        if self.kv_cache == "fp8" and config.kv_lora_rank % self.kv_cache_tile_size:
            raise ValueError(
                f"kv_cache='fp8' quantizes tiles of kv_cache_tile_size={self.kv_cache_tile_size}: kv_lora_rank="
                f"{config.kv_lora_rank} must be a multiple of it"
            )

    def encode_index_keys(self, keys: torch.Tensor):
        """Indexer keys `[..., DI]` as the store keeps them: the tensor itself (bf16) or MXFP8 `QuantizedRows`."""
        if self.indexer == "bf16":
            return keys
        elements, scales = mxfp8_quantize(keys, self.mxfp8_scale_rule)
        return QuantizedRows(elements, scales, keys[..., :0])

    def quantize_index_queries(self, queries: torch.Tensor) -> torch.Tensor:
        """Indexer queries `[..., DI]`, MXFP8-rounded (dynamic, per block of 32) when the keys are MXFP8: the values
        an MXFP8 GEMM would see, in the query dtype (exact: E4M3 · 2^e fits bf16 for |e| < 126)."""
        if self.indexer == "bf16":
            return queries
        return mxfp8_dequantize(*mxfp8_quantize(queries, self.mxfp8_scale_rule), dtype=queries.dtype)

    def encode_kv_rows(self, rows: torch.Tensor, latent_width: int):
        """Latent rows `[..., C + R]` as the store keeps them: the tensor (bf16) or `QuantizedRows` with the latent
        `C` in FP8 tiles and the RoPE part `R` unquantized."""
        if self.kv_cache == "bf16":
            return rows
        elements, scales = fp8_tile_quantize(rows[..., :latent_width], self.kv_cache_tile_size)
        return QuantizedRows(elements, scales, rows[..., latent_width:])


__all__ = [
    "CacheFormats",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP8_AMAX_FLOOR",
    "FP8_TILE_SIZE",
    "INDEXER_FORMATS",
    "KV_CACHE_FORMATS",
    "MX_BLOCK_SIZE",
    "MX_SCALE_RULES",
    "QUANT_METHOD",
    "PLANAR_ROWS",
    "PackedKVRows",
    "QuantizedRows",
    "SplitRows",
    "dequantize_blocks",
    "e8m0_to_float",
    "fp8_tile_dequantize",
    "fp8_tile_quantize",
    "mxfp4_dequantize",
    "mxfp4_quantize",
    "mxfp4_unpack",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "stored_planes",
]
