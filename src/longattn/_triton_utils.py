"""Host-side helpers shared by every op's Triton launcher (imports triton: load lazily)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._cascade import _truthy, cuda_capability, interpreter_active

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def scale_strides(scale: torch.Tensor | None) -> tuple[int, int]:
    """(stride over KV heads, stride over channels) of an int8 cache's ``[1]`` or
    ``[KV, 1, H]`` scale; ``(0, 0)`` for a per-tensor scale or none."""
    if scale is None or scale.dim() == 1:
        return 0, 0
    return scale.stride(0), scale.stride(2)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints. ``triton.cdiv`` is a constexpr function in triton 3.6: a
    host call costs ~3 us (it re-imports and unwraps its arguments each time), and a decode
    step's launchers make a few dozen such calls."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for ``n <= 0``), as ``triton.next_power_of_2``
    but a plain host function (see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def interpret() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels take their interpreter-safe loop forms)."""
    return interpreter_active()


@functools.cache
def num_sms(device_index: int) -> int:
    """Multiprocessor count of a CUDA device (4 under the interpreter / without CUDA)."""
    if interpret() or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    index = (t.device.index or 0) if t.device.type == "cuda" else 0
    return num_sms(index)


@functools.cache
def _sm90_compiled(device_index: int) -> bool:
    """Compiled (not interpreted) kernels on an sm_90+ device."""
    return not interpret() and cuda_capability(device_index)[0] >= 9


def _hopper_feature_on(device: torch.device, disable_env: str) -> bool:
    """An sm_90+ launch feature: CUDA, compiled kernels, sm_90+, and ``disable_env`` unset
    (read per call)."""
    if device.type != "cuda" or _truthy(os.environ.get(disable_env)):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm90_compiled(index)


def cfg_flag(cfg: dict, key: str, default=False, *, allow_none=False, what="cfg"):
    """``cfg[key]`` (``default`` when absent), checked to be a bool (or None with
    ``allow_none``): a tuning flag given as 1 or "yes" would silently pick another build.
    ``what`` names the dict in the error (e.g. "select cfg")."""
    value = cfg.get(key, default)
    if not isinstance(value, bool) and not (allow_none and value is None):
        kind = "a bool or None" if allow_none else "a bool"
        raise ValueError(f"{what}[{key!r}] must be {kind}, got {value!r}")
    return value


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (``pdl_kwargs``):
    CUDA sm_90+, not the interpreter, and ``LONGATTN_DISABLE_PDL`` unset (read per call)."""
    return _hopper_feature_on(device, "LONGATTN_DISABLE_PDL")


@functools.cache
def _gluon_hopper_available() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def gluon_hopper_enabled(device: torch.device) -> bool:
    """Whether the Gluon sm_90 kernels may run on ``device``: CUDA capability exactly 9.x (their
    wgmma / setmaxnreg code is sm_90a-only), compiled kernels, a triton with Gluon's Hopper
    module, and ``LONGATTN_DISABLE_GLUON`` unset (read per call)."""
    if not _hopper_feature_on(device, "LONGATTN_DISABLE_GLUON"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cuda_capability(index)[0] == 9 and _gluon_hopper_available()


def tma_ok(t: torch.Tensor) -> bool:
    """Whether ``t`` can back a TMA tensor descriptor here: CUDA sm_90+, not the interpreter,
    ``LONGATTN_DISABLE_TMA`` unset (read per call), 16-byte aligned base and strides (the last
    dimension contiguous)."""
    if not _hopper_feature_on(t.device, "LONGATTN_DISABLE_TMA"):
        return False
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all((st * size) % 16 == 0 for st in t.stride()[:-1])
    )


# The block-score and select launches of the sparse chain let the next PDL-launched grid launch
# as soon as all their programs passed their own wait (``release_dependents``), so its launch
# overlaps their run instead of following their last program; read per launch. H100, session 28
# (``benchmarks/results/sparse_early_trigger_ab_h100.json``, same process): the layer op at B=1
# S=1 T=128K / 256K 18.62 / 21.49 -> 18.19 / 20.71 us alone, 17.98 / 20.21 with the early loads
# (select EARLY_SCORES, DSA EARLY_CNT, MERGE_EARLY_O).
PDL_EARLY_TRIGGER = True


def pdl_kwargs(t: torch.Tensor, trigger: bool = False) -> dict:
    """Launch keywords of a decode-chain kernel that takes a ``PDL: tl.constexpr`` flag.

    Where ``pdl_enabled(t.device)``, the kernel is launched with programmatic dependent launch
    (``launch_pdl``): the GPU may start launching it while the previous kernel of the stream
    drains, and the kernel's first statement (``wait_prior_grids``) blocks until that kernel
    has completed and its memory is visible. Every kernel still starts its loads after all
    earlier work of the stream; only the launch latency overlaps the previous kernel's tail
    (H200, a CUDA graph of 16 dependent 132-CTA kernels: 1.61 -> 1.16 us per kernel), or its
    whole run where that kernel releases its dependents early (``release_dependents``).

    ``trigger`` (kernels with a ``TRIGGER`` constexpr): also ``TRIGGER`` = PDL on and
    ``PDL_EARLY_TRIGGER``, for ``release_dependents``."""
    if pdl_enabled(t.device):
        kw = {"PDL": True, "launch_pdl": True}
        return dict(kw, TRIGGER=PDL_EARLY_TRIGGER) if trigger else kw
    return {"PDL": False, "TRIGGER": False} if trigger else {"PDL": False}


@triton.jit
def wait_prior_grids(PDL: tl.constexpr):
    """First statement of a kernel launched with ``pdl_kwargs``: wait for the previous grid."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents(TRIGGER: tl.constexpr):
    """Right after ``wait_prior_grids``: the next PDL-launched grid may launch once every
    program of this grid has called this (or exited), so never before this grid's last
    programs are resident (no slot is taken from them); its ``wait_prior_grids`` still blocks
    until this grid has completed and its memory is visible: only the launch overlaps this
    grid's run. Its waiting programs hold SM slots meanwhile: for launches followed by small
    grids (the DSA split grid releasing the merge lost 3-4% at B=1 S=1, H100 session 28)."""
    if TRIGGER:
        gdc_launch_dependents()


_INTERPRET = tl.constexpr(interpreter_active())  # the mode triton fixed at import (int8x4_to_fp16)


@triton.jit
def sm_clock(dep):
    """The SM's cycle counter (``%clock64``, int64) read once the int32 scalar ``dep`` exists:
    a phase mark of the kernels' opt-in ``CLOCKS`` builds (GPU only; the interpreter has no
    inline assembly). The dependence keeps the read after the work that made ``dep``."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1
    )


# The offset of ``int8_to_fp16``'s exact fp16 before its subtract: ``1024 + t + 128``.
INT8_SHIFT = tl.constexpr(1152.0)


@triton.jit
def int8_to_fp16(t, SHIFTED: tl.constexpr = False):
    """Exact int8 -> fp16 without the I2F unit: the fp16 with bits ``0x6400 | (t ^ 0x80)`` is
    ``1024 + t + 128``; one integer op (xor) and one fp16 subtract per element. ``SHIFTED``:
    ``t + INT8_SHIFT`` (also exact), without the subtract (GQA decode's ``K_SHIFT`` /
    ``V_SHIFT``)."""
    u = t.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x6480
    if SHIFTED:
        return u.to(tl.float16, bitcast=True)
    return u.to(tl.float16, bitcast=True) - INT8_SHIFT


# the packed fp16 subtracts of ``int8_to_fp16``'s 1152 (0x6480) from $0 and $1
_SUBTRACT_1152_PTX = """
    mov.b32 c, 0x64806480;
    sub.f16x2 $0, $0, c;
    sub.f16x2 $1, $1, c;"""


def _int8_bytes_to_fp16_asm(sel0: str, sel1: str, shifted: bool = False) -> str:
    """PTX: the four int8 of one 32-bit register ($2) -> two exact fp16 pairs: the bytes that
    byte-permute selectors ``sel0`` / ``sel1`` pick (0-3) under fp16 exponent bytes 0x64 (4),
    sign bits flipped first and the 1152 subtracted after (``int8_to_fp16``), into $0 / $1.
    ``shifted``: without the subtracts (``t + INT8_SHIFT``)."""
    sub = "" if shifted else _SUBTRACT_1152_PTX
    return f"""{{
    .reg .b32 u, c;
    xor.b32 u, $2, 0x80808080;
    prmt.b32 $0, u, 0x64646464, {sel0};
    prmt.b32 $1, u, 0x64646464, {sel1};{sub}
}}"""


# four int8 in one 32-bit register ($2) -> four exact fp16 in two ($0: bytes 0, 1; $1: 2, 3)
_INT8X4_TO_FP16_ASM = tl.constexpr(_int8_bytes_to_fp16_asm("0x4140", "0x4342"))
_INT8X4_TO_FP16_SHIFTED_ASM = tl.constexpr(_int8_bytes_to_fp16_asm("0x4140", "0x4342", True))


@triton.jit
def int8x4_to_fp16(t, SHIFTED: tl.constexpr = False):
    """``int8_to_fp16`` four bytes at a time (PTX): one xor flips the four sign bits, two byte
    permutes place the bytes under fp16 exponent bytes 0x64 (``1024 + t + 128``), two packed
    fp16 subtracts remove the 1152 (not with ``SHIFTED``). The interpreter runs
    ``int8_to_fp16`` (same values)."""
    if _INTERPRET:
        return int8_to_fp16(t, SHIFTED)
    return tl.inline_asm_elementwise(
        asm=_INT8X4_TO_FP16_SHIFTED_ASM if SHIFTED else _INT8X4_TO_FP16_ASM,
        constraints="=r,=r,r",
        args=[t],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


def words_aligned(*caches, word: int = 4) -> bool:
    """Whether int8 caches ``[B, KV, C, H]`` can be read as ``word``-byte words (the decode
    kernels' ``WIDE_I8``: int32, ``V_PAIRS``: int16): every row of every (sequence, KV head)
    starts on a ``word``-byte boundary and the head size is a multiple of ``word``."""
    return all(
        c.data_ptr() % word == 0
        and c.shape[-1] % word == 0
        and all(st % word == 0 for st in c.stride()[:3])
        for c in caches
    )


def int8_pairs_ok(cache, fp16_operand: bool) -> bool:
    """Whether an int8 cache ``[B, KV, C, H]`` may feed an fp16 dot operand read as int16
    channel pairs (the decode kernels' ``V_PAIRS`` / ``K_PAIRS``): int8, an fp16 operand, and
    2-byte aligned rows (``words_aligned``)."""
    return cache.dtype == torch.int8 and fp16_operand and words_aligned(cache, word=2)


# two int16 in one 32-bit register ($2), each holding two int8 (its low byte: an even channel,
# its high byte: the odd one) -> the even channels as two exact fp16 in $0 (bytes 0, 2), the
# odd ones in $1 (bytes 1, 3)
_INT8_PAIRS_TO_FP16_ASM = tl.constexpr(_int8_bytes_to_fp16_asm("0x4240", "0x4341"))
_INT8_PAIRS_TO_FP16_SHIFTED_ASM = tl.constexpr(_int8_bytes_to_fp16_asm("0x4240", "0x4341", True))


@triton.jit
def int8_pairs_to_fp16(w, SHIFTED: tl.constexpr = False):
    """``(even, odd)`` exact fp16, each of ``w``'s shape: the int8 channel pairs of an int8
    tile read as int16 words ``w`` (byte 0: channel 2j, byte 1: channel 2j + 1), by
    ``int8x4_to_fp16``'s xor / byte permute / fp16 subtract, two words per 32-bit register.
    Read this way a V tile ``[keys, HEAD // 2]`` reaches the P.V MMA operand layout (two
    consecutive keys per register) by ``ldmatrix.trans`` of 16-bit words, where int8 bytes take
    one shared load each (``cache_to_dot``). ``SHIFTED``: ``t + INT8_SHIFT`` (``int8_to_fp16``).
    The interpreter runs ``int8_to_fp16``."""
    if _INTERPRET:
        lo = (w & 0xFF).to(tl.uint8)
        hi = ((w >> 8) & 0xFF).to(tl.uint8)
        return int8_to_fp16(lo, SHIFTED), int8_to_fp16(hi, SHIFTED)
    asm: tl.constexpr = _INT8_PAIRS_TO_FP16_SHIFTED_ASM if SHIFTED else _INT8_PAIRS_TO_FP16_ASM
    return _fp16_pairs_asm(w, asm, "=r,=r,r")


@triton.jit
def _fp16_pairs_asm(w, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr):
    """Two fp16 tensors of ``w``'s shape from the pure PTX ``ASM`` run on two elements of
    ``w`` at a time (one 32-bit register of int16 words; the first of an int32 pair)."""
    return tl.inline_asm_elementwise(
        asm=ASM, constraints=CONSTRAINTS, args=[w], dtype=(tl.float16, tl.float16), is_pure=True,
        pack=2,
    )  # fmt: skip


@triton.jit
def interleave_channels(acc_e, acc_o):
    """``[M, HEAD]``: column ``2j`` from ``acc_e [M, HEAD // 2]``, ``2j + 1`` from ``acc_o`` (the
    even / odd accumulators of a ``V_PAIRS`` decode loop)."""
    M: tl.constexpr = acc_e.shape[0]
    HALF: tl.constexpr = acc_e.shape[1]
    return tl.reshape(tl.join(acc_e, acc_o), (M, 2 * HALF))  # [M, HALF, 2] -> [M, HEAD]


@triton.jit
def _int8_byte_to_fp16(w, j):
    """Byte ``j`` (0..3, little-endian: the int8 at address ``4 * c + j``) of int32 words ``w``
    as an exact fp16 (the interpreter's ``int8_words_to_fp16``)."""
    return int8_to_fp16(((w >> (8 * j)) & 0xFF).to(tl.uint8).to(tl.int8, bitcast=True))


@triton.jit
def _int8_words_to_fp16_pairs(w2):
    """``(lo, hi)``, each ``[.., 2]`` fp16: bytes 0, 1 and 2, 3 of the int32 words ``w2 [.., 2]``
    (``join(w, w)``: the asm reads the pair's first element), one ``int8x4_to_fp16`` per word:
    its two packed halves become the two outputs' registers without an unpack."""
    if _INTERPRET:
        e = tl.arange(0, 2)  # [2]
        return _int8_byte_to_fp16(w2, e), _int8_byte_to_fp16(w2, e + 2)
    return _fp16_pairs_asm(w2, _INT8X4_TO_FP16_ASM, "=r,=r,r,r")


@triton.jit
def _dot_width_fence(x):
    """Identity on 16-bit ``x`` as a non-pure asm (no instruction after ptxas): it ends the
    backward walk in which Triton's MMAv2 lowering looks for the narrowest load feeding a dot
    operand (``computeOrigBitWidth``: int8 loads, and any ``join``, give ``kWidth`` 4)."""
    if _INTERPRET:
        return x
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2
    )


@triton.jit
def int8_words_to_fp16(w, ROWS: tl.constexpr, COLS: tl.constexpr):
    """An int8 cache tile read as int32 words ``w [ROWS, COLS // 4]`` -> the exact ``[ROWS,
    COLS]`` fp16 tile in a plain blocked layout (4 channels per thread), so the 16-bit MMA
    operand comes from shared memory by ``ldmatrix`` at ``kWidth`` 2 (``_dot_width_fence``).
    The default int8 path (``cache_to_dot``) loads the operand layout straight from the int8
    tile at ``kWidth`` 4, where V's bytes arrive one shared load each and Q is rebuilt from
    64-bit loads and register moves every tile (sm_90 SASS of the GQA decode loop, BLOCK_N
    128: 1023 -> 724 instructions per tile). The decode kernels' ``WIDE_I8`` option; off by
    default: slower on the H100 (the fp16 tiles' trip through shared memory; DEVELOPERS.md)."""
    lo, hi = _int8_words_to_fp16_pairs(tl.join(w, w))  # [ROWS, COLS // 4, 2] each
    t = tl.permute(tl.join(lo, hi), (0, 1, 3, 2))  # [ROWS, COLS // 4, 2 (hi), 2 (pair)]
    return _dot_width_fence(tl.reshape(t, (ROWS, COLS)))


@triton.jit
def cache_to_dot(t, DOT_DTYPE: tl.constexpr, KEYS: tl.constexpr, SHIFTED: tl.constexpr = False):
    """A cache tile ``t`` converted to the dot operand dtype (int8 -> exact integers).

    int8 -> fp16 skips the I2F unit: K tiles (``KEYS``) reach their MMA operand registers four
    bytes (consecutive channels) per register, which ``int8x4_to_fp16`` converts in 5
    instructions; V tiles arrive one byte per register (key-major pairs), where the
    per-element ``int8_to_fp16`` is cheaper (the byte path: the decode kernels' ``V_PAIRS``
    default reads V as int16 channel pairs instead, ``int8_pairs_to_fp16``). ``SHIFTED`` (int8
    -> fp16 only): ``t + INT8_SHIFT``, one fp16 subtract per two elements fewer."""
    if t.dtype == tl.int8 and DOT_DTYPE == tl.float16:
        if KEYS:
            return int8x4_to_fp16(t, SHIFTED)
        return int8_to_fp16(t, SHIFTED)
    return t.to(DOT_DTYPE)
