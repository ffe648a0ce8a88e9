"""Public DynamicSparseAttention op: sparse GQA over externally selected positions."""

from __future__ import annotations

import math
import os

import torch

from .. import _cascade
from .._attention_torch import contiguous_positions
from .._common import (
    FLOAT_DTYPES,
    call_op,
    check_epsilon,
    check_flag,
    check_nonneg_int,
    check_position_range,
    check_positive_int,
    check_rotary_caches,
    check_tensor,
    data_checks_allowed,
    host_ranges,
    resolve_scale,
)
from ._params import DSAParams
from .chunked import dsa_chunked
from .reference import dsa_reference

OP_NAME = "dynamic_sparse_attention"
_FLOATS = (*FLOAT_DTYPES, torch.float64)
_CACHE_DTYPES = (*_FLOATS, torch.int8)
_INDEX = (torch.int32, torch.int64)
_MODES = ("selected_only", "local_plus_selected")
_SOURCES = ("main", "auxiliary")
_VALID_PAIRS = (("selected_only", "main"), ("local_plus_selected", "auxiliary"))

__all__ = ["dynamic_sparse_attention", "validate_selection"]


def gates(query: torch.Tensor, key=None, value=None, present_key=None, aux_k=None, aux_v=None,
          p: DSAParams | None = None):  # fmt: skip
    """Tier gates: {tier: gate(explicit) -> (ok, reason)}. The triton gate checks the kernels'
    features (sparse/triton/__init__.py), then the device, then that the tier imports."""

    def triton_gate(explicit: bool):
        if p is None or present_key is None:
            return False, "triton gate needs the op's tensors and params"
        from .triton import dsa_dtypes, dsa_unsupported

        args = (query, key, value, present_key, aux_k, aux_v, p)
        why = dsa_unsupported(*args)
        if why:
            return False, why
        ok, reason = _cascade.triton_device_gate(query.device, dsa_dtypes(*args), explicit)
        if not ok:
            return ok, reason
        try:
            from .triton.decode import dsa_triton  # noqa: F401
        except Exception as exc:  # pragma: no cover - depends on the install
            return False, f"the sparse triton tier failed to import ({type(exc).__name__}: {exc})"
        return True, reason

    return {"triton": triton_gate, "chunked": _cascade.always, "reference": _cascade.always}


def _run(
    query, key, value, present_key, present_value, aux_k, aux_v, sel, cnt, seqlens_k, p, backend,
    tier=None,
):  # fmt: skip
    """The tier ``backend`` selects (``tier``: one the caller already selected) on the inputs."""
    if tier is None:
        g = gates(query, key, value, present_key, aux_k, aux_v, p)
        tier = _cascade.select_backend(OP_NAME, backend, g)
    if tier == "triton":
        from .triton.decode import dsa_triton

        return dsa_triton(
            query, key, value, present_key, present_value, aux_k, aux_v, sel, cnt, seqlens_k, p
        )
    fn = dsa_chunked if tier == "chunked" else dsa_reference
    return fn(query, key, value, present_key, present_value, aux_k, aux_v, sel, cnt, seqlens_k, p)


def _dsa_op_impl(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    present_key: torch.Tensor,
    present_value: torch.Tensor,
    auxiliary_key: torch.Tensor | None,
    auxiliary_value: torch.Tensor | None,
    selected_indices: torch.Tensor,
    selected_counts: torch.Tensor,
    seqlens_k: torch.Tensor,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    head_sink: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_heads: int,
    kv_num_heads: int,
    head_size: int,
    scale: float,
    local_window_size: int,
    attention_mode: str,
    selected_kv_source: str,
    do_rotary: bool,
    rotary_interleaved: bool,
    rotary_offset: int,
    smooth_softmax: bool,
    qk_norm_epsilon: float,
    auxiliary_kv_shared: bool,
    is_first_prompt: bool,
    total_sequence_length: int,
    query_dtype: torch.dtype | None,
    backend: str,
) -> torch.Tensor:
    p = dsa_params(locals())
    return _run(
        query,
        key,
        value,
        present_key,
        present_value,
        auxiliary_key,
        auxiliary_value,
        selected_indices,
        selected_counts,
        seqlens_k,
        p,
        backend,
    )


_PARAM_FIELDS = (
    "cos_cache", "sin_cache", "position_ids", "head_sink", "q_norm_weight", "k_norm_weight",
    "k_scale", "v_scale", "num_heads", "kv_num_heads", "head_size", "scale",
    "local_window_size", "attention_mode", "selected_kv_source", "do_rotary",
    "rotary_interleaved", "rotary_offset", "smooth_softmax", "qk_norm_epsilon",
    "auxiliary_kv_shared", "is_first_prompt", "total_sequence_length", "query_dtype",
)  # fmt: skip


def dsa_params(args: dict) -> DSAParams:
    """DSAParams from an op implementation's arguments (``locals()``): the ``_PARAM_FIELDS``."""
    return DSAParams(**{name: args[name] for name in _PARAM_FIELDS})


_dsa_op = torch.library.custom_op(
    "longattn::dynamic_sparse_attention", mutates_args=("present_key", "present_value")
)(_dsa_op_impl)


@_dsa_op.register_fake
def _(query, key, value, present_key, present_value, *args):
    # args follow _dsa_op: ..., num_heads = args[13], kv_num_heads = args[14], head_size = args[15]
    num_heads, head_size = args[13], args[15]
    b, s = query.shape[:2]
    return query.new_empty((b, s, num_heads * head_size))


# ---------------------------------------------------------------------------------------------
# Validation.


def _strict_env() -> bool:
    value = os.environ.get("LONGATTN_STRICT_VALIDATION")
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


def validate_selection(
    selected_indices: torch.Tensor,
    selected_counts: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    s: int,
    is_first_prompt: bool,
    source: str,
    capacity: int,
    local_window_size: int = -1,
) -> None:
    """Strict checks of the selection metadata (reads values: host sync). Raises ``ValueError``
    for the first violated rule: count < 0 or > max_selected, count > capacity (main cache
    capacity C, or auxiliary length A), padding entry (past the count) not -1, entry out of
    range (``< 0`` or ``>= capacity``), future main position (``> qpos``), duplicate entries.
    Main entries inside the local window are allowed (the kernel drops them)."""
    rows, m = selected_indices.shape
    cnt = selected_counts.to(torch.int64)
    idx = selected_indices.to(torch.int64)
    j = torch.arange(m, device=idx.device)

    def fail(what: str, mask: torch.Tensor, detail) -> None:
        bad = mask.nonzero()
        if bad.numel():
            first = tuple(int(x) for x in bad[0])
            raise ValueError(f"selected_indices/selected_counts: {what} ({detail(first)})")

    fail(
        f"selected_counts must lie in [0, max_selected = {m}]",
        (cnt < 0) | (cnt > m),
        lambda f: f"row {f[0]} has count {int(cnt[f[0]])}",
    )
    name = "main cache capacity" if source == "main" else "auxiliary length"
    fail(
        f"selected_counts exceeds the {name} {capacity}",
        cnt > capacity,
        lambda f: f"row {f[0]} has count {int(cnt[f[0]])}",
    )
    used = j[None, :] < cnt[:, None]
    fail(
        "entries past selected_counts (padding) must be -1",
        ~used & (idx != -1),
        lambda f: f"row {f[0]} entry {f[1]} = {int(idx[f])} with count {int(cnt[f[0]])}",
    )
    fail(
        f"entry out of range [0, {capacity}) ({name})",
        used & ((idx < 0) | (idx >= capacity)),
        lambda f: f"row {f[0]} entry {f[1]} = {int(idx[f])}",
    )
    if source == "main":
        qpos, _ = contiguous_positions(seqlens_k, s, is_first_prompt)
        qp = qpos.reshape(-1)
        fail(
            "entry is a future position (> the row's qpos)",
            used & (idx > qp[:, None]),
            lambda f: f"row {f[0]} entry {f[1]} = {int(idx[f])} > qpos {int(qp[f[0]])}",
        )
    big = torch.where(used, idx, -1 - j[None, :])  # unused entries: distinct negatives
    srt = big.sort(-1).values
    fail(
        "duplicate entries",
        (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0),
        lambda f: f"row {f[0]} repeats position {int(srt[f[0], f[1] + 1])}",
    )


def _check_opt(name, t, **kw):
    return None if t is None else check_tensor(name, t, **kw)


def _check_scale(name, scale, kv, h, dev):
    check_tensor(name, scale, dtypes=(torch.float32,), device=dev)
    if tuple(scale.shape) not in ((1,), (kv, 1, h)):
        raise ValueError(
            f"{name} must be per-tensor [1] or per-channel [{kv}, 1, {h}] fp32, "
            f"got {tuple(scale.shape)}"
        )


def dynamic_sparse_attention(
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    auxiliary_key: torch.Tensor | None = None,
    auxiliary_value: torch.Tensor | None = None,
    *,
    selected_indices: torch.Tensor,
    selected_counts: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_sequence_length: int,
    num_heads: int,
    kv_num_heads: int,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    head_sink: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: int = -1,
    attention_mode: str = "selected_only",
    selected_kv_source: str = "main",
    do_rotary: bool = False,
    rotary_interleaved: bool = False,
    rotary_offset: int = 0,
    qk_norm_epsilon: float = 1e-6,
    smooth_softmax: bool = False,
    auxiliary_kv_shared: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
    query_dtype: torch.dtype | None = None,
    validate: bool | str = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse GQA over externally selected positions (ORT ``DynamicSparseAttention``).

    New tokens: Q and the new K get QK-norm (``q/k_norm_weight``) then rotary (``do_rotary``)
    in fp32; K (rotated) and V (raw) are appended to the contiguous main cache at rows ``qpos``
    as GroupQueryAttention does. Each query row ``r = b*S + s`` then attends, with one joint fp32
    softmax (plus the sink), over its candidates:

    - ``attention_mode="selected_only"``, ``selected_kv_source="main"`` (QSA): the first
      ``selected_counts[r]`` entries of ``selected_indices[r]``, main-cache positions, valid
      iff ``0 <= idx <= qpos`` and ``idx < C``;
    - ``"local_plus_selected"`` + ``"auxiliary"``: the main-cache window ``qpos-W+1 .. qpos``
      (``W = local_window_size > 0``) and the selected rows ``0 <= idx < A`` of the auxiliary
      (compressed, read-only) K/V.

    Invalid entries are skipped (``validate=True`` or ``LONGATTN_STRICT_VALIDATION=1`` raises
    instead, eager mode only). Rows with no valid candidate give zeros (with a sink too).

    Args:
        query: ``[B, S, N*H]`` bf16/fp16/fp32 (fp64: oracle), or packed ``[B, S, (N+2*KV)*H]``
            with ``key``/``value`` None. Sets the output dtype.
        key, value: ``[B, S, KV*H]``, each any float dtype (e.g. fp16 V with bf16 Q: an fp16 V
            enters an fp16 cache without loss).
        past_key, past_value: ``[B, KV, C, H]`` main cache (BNSH, last dim contiguous) in the
            cache dtype: float (query's dtype, or fp16 with bf16 activations) or int8 (with
            ``k_scale``/``v_scale``). When ``C >= total_sequence_length`` the new rows are
            written **in place** and the returned presents are these tensors; otherwise new
            ``[B, KV, total_sequence_length, H]`` presents hold the past rows (rest zero).
        auxiliary_key, auxiliary_value: ``[B, KV, A, H]`` any float dtype each, used as stored
            (never converted to fp16; no rotary). ``auxiliary_kv_shared=True``: V is
            ``auxiliary_key`` and ``auxiliary_value`` must be None.
        selected_indices: ``[B*S, M]`` int32 (int64 accepted); selected_counts ``[B*S]`` int32.
        seqlens_k: ``[B]`` int32, total length minus one. total_sequence_length: host int, max
            total over the batch; ``S == total_sequence_length`` is the first prompt
            (``qpos = s``; rows ``s > seqlens_k[b]`` are padding: zero output, nothing written),
            else ``qpos = seqlens_k[b] + 1 - S + s``.
        num_heads, kv_num_heads: N and KV (N % KV == 0).
        cos_cache, sin_cache: ``[max_pos, rotary_dim/2]`` (fp32 recommended, last dim
            contiguous), for do_rotary; position = ``position_ids [B, S]`` (int64/int32) if
            given, else qpos.
        do_rotary, rotary_interleaved: rotary on Q and the new K; split-half pairs ``(i, i +
            rotary_dim/2)`` by default, adjacent pairs ``(2i, 2i + 1)`` when interleaved.
        rotary_offset: first rotated channel (``>= 0``; channels ``rotary_offset ..
            rotary_offset + rotary_dim`` rotate, the rest pass through); the Triton prologue
            takes 0 only (another offset runs the torch prologue).
        q_norm_weight, k_norm_weight: ``[H]`` QK-norm weights (eps = qk_norm_epsilon).
        head_sink: ``[N]`` sink logits (any float dtype); else ``smooth_softmax`` adds a zero
            logit; head_sink wins when both are given.
        k_scale, v_scale: fp32 ``[1]`` or ``[KV, 1, H]``, only (and required) with an int8
            cache: ``q = round(x / scale)`` clamped to [-127, 127].
        scale: logit scale; None/0 means ``1/sqrt(H)``.
        is_causal: must be True (the only mode ORT defines).
        local_window_size: W > 0 in local_plus_selected mode; -1 in selected_only mode.
        kv_cache_dtype: cache dtype when ``past_key`` is None (default: query's dtype, int8 when
            k_scale is given); must match ``past_key.dtype`` otherwise.
        query_dtype: round the prepared Q (after norm + rotary, fp32) once to this dtype (e.g.
            fp16 with bf16 activations, as ORT's FP16-query path does). None: the torch tiers
            keep Q in fp32; the triton tier rounds Q once to the dot dtype (fp16 for bf16
            activations with an fp16 cache, else the activation dtype; for an int8 K cache the
            k_scale is folded into Q before that rounding, and with 16-bit activations that Q
            is fp16 with each (token, head) row scaled by a power of two: 11 significant bits,
            no overflow or underflow, the factor undone exactly on the fp32 logits; in
            local_plus_selected mode the float auxiliary keys take a second Q without the fold,
            in the activation dtype; int8 V enters the P.V dot as fp16 with P rounded to fp16).
        validate: how much of the index tensors' *values* is checked on the host (each level
            **synchronizes with the device** once; all skipped under torch.compile tracing and
            CUDA-graph capture). ``False`` (default): seqlens_k's range and position_ids inside
            cos_cache; invalid selection entries are skipped, as the spec says. ``True``: also
            the selection metadata, strictly (counts, -1 padding, entries in range, no
            duplicates; also forced by ``LONGATTN_STRICT_VALIDATION=1``). ``"off"``: no value
            check and no sync (hot eager decode loops): unchecked values never read or write
            outside the caches, but the result is then undefined. Shape/dtype errors are always
            raised.
        backend: "auto", "triton", "chunked" or "reference".

    Returns:
        ``(output [B, S, N*H] in query's dtype, present_key, present_value)``.
    """
    args, present_key, present_value = _prepare(**locals())
    return call_op(_dsa_op, _dsa_op_impl, *args), present_key, present_value


def _prepare(
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    past_key: torch.Tensor | None = None,
    past_value: torch.Tensor | None = None,
    auxiliary_key: torch.Tensor | None = None,
    auxiliary_value: torch.Tensor | None = None,
    *,
    selected_indices: torch.Tensor,
    selected_counts: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_sequence_length: int,
    num_heads: int,
    kv_num_heads: int,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    head_sink: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: int = -1,
    attention_mode: str = "selected_only",
    selected_kv_source: str = "main",
    do_rotary: bool = False,
    rotary_interleaved: bool = False,
    rotary_offset: int = 0,
    qk_norm_epsilon: float = 1e-6,
    smooth_softmax: bool = False,
    auxiliary_kv_shared: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
    query_dtype: torch.dtype | None = None,
    validate: bool | str = False,
    backend: str = "auto",
    check_selection: bool = True,
) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """``dynamic_sparse_attention``'s checks and presents: ``(the op's arguments, present_key,
    present_value)``. ``check_selection=False``: the selection is produced later by the
    caller (``sparse_attention_layer``): only its shapes are checked, never its values."""
    _cascade.check_backend_name(backend)
    is_causal = check_flag("is_causal", is_causal)
    do_rotary = check_flag("do_rotary", do_rotary)
    rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    smooth_softmax = check_flag("smooth_softmax", smooth_softmax)
    auxiliary_kv_shared = check_flag("auxiliary_kv_shared", auxiliary_kv_shared)
    check_tensor("query", query, dtypes=_FLOATS, ndim=3, contiguous_last=True)
    b, s, d = query.shape
    dev = query.device
    n = check_positive_int("num_heads", num_heads)
    kv = check_positive_int("kv_num_heads", kv_num_heads)
    if n % kv:
        raise ValueError(f"num_heads ({n}) must be a multiple of kv_num_heads ({kv})")
    if (key is None) != (value is None):
        raise ValueError("key and value must be given together (or neither, for packed QKV)")
    packed = key is None
    heads = n + 2 * kv if packed else n
    if d % heads:
        what = (
            "(num_heads + 2 * kv_num_heads) * head_size (packed)"
            if packed
            else "num_heads * head_size"
        )
        raise ValueError(
            f"query.shape[-1] = {d} must be {what} with num_heads={n}, kv_num_heads={kv}"
        )
    h = d // heads
    if not packed:
        check_tensor(
            "key", key, dtypes=_FLOATS, shape=(b, s, kv * h), device=dev, contiguous_last=True
        )
        check_tensor(
            "value", value, dtypes=_FLOATS, shape=(b, s, kv * h), device=dev, contiguous_last=True
        )
    if isinstance(total_sequence_length, bool | torch.Tensor):
        raise TypeError(
            "total_sequence_length must be a host int (not a tensor: reading one would sync), "
            f"got {type(total_sequence_length).__name__}"
        )
    t_max = check_positive_int("total_sequence_length", total_sequence_length)
    if s > t_max:
        raise ValueError(f"S = {s} new tokens exceed total_sequence_length = {t_max}")
    check_tensor(
        "seqlens_k", seqlens_k, dtypes=(torch.int32,), shape=(b,), device=dev, contiguous_last=True
    )
    if not is_causal:
        raise ValueError("is_causal=False is not supported (DynamicSparseAttention is causal)")

    # modes
    if attention_mode not in _MODES:
        raise ValueError(f"attention_mode must be one of {_MODES}, got {attention_mode!r}")
    if selected_kv_source not in _SOURCES:
        raise ValueError(
            f"selected_kv_source must be one of {_SOURCES}, got {selected_kv_source!r}"
        )
    if (attention_mode, selected_kv_source) not in _VALID_PAIRS:
        raise ValueError(
            f"attention_mode={attention_mode!r} with selected_kv_source={selected_kv_source!r} is "
            f"not a valid pair; valid: {_VALID_PAIRS}"
        )
    if not isinstance(local_window_size, int) or isinstance(local_window_size, bool):
        raise ValueError(f"local_window_size must be an int, got {local_window_size!r}")
    local = attention_mode == "local_plus_selected"
    if local and local_window_size <= 0:
        raise ValueError(
            f"local_window_size must be > 0 in local_plus_selected mode, got {local_window_size}"
        )
    if not local and local_window_size != -1:
        raise ValueError(
            f"local_window_size must be -1 in selected_only mode, got {local_window_size}"
        )

    # main cache
    if (past_key is None) != (past_value is None):
        raise ValueError("past_key and past_value must be given together (or neither)")
    if past_key is not None and past_key is past_value:
        raise ValueError("past_key and past_value must be different tensors (got the same one)")
    if past_key is not None:
        check_tensor(
            "past_key",
            past_key,
            dtypes=_CACHE_DTYPES,
            shape=(b, kv, None, h),
            device=dev,
            contiguous_last=True,
        )
        check_tensor(
            "past_value",
            past_value,
            dtypes=(past_key.dtype,),
            shape=tuple(past_key.shape),
            device=dev,
            contiguous_last=True,
        )
        if kv_cache_dtype is not None and kv_cache_dtype != past_key.dtype:
            raise TypeError(
                f"kv_cache_dtype {kv_cache_dtype} differs from past_key.dtype {past_key.dtype}"
            )
        cache_dtype = past_key.dtype
    elif kv_cache_dtype is not None:
        cache_dtype = kv_cache_dtype
    else:
        cache_dtype = torch.int8 if k_scale is not None else query.dtype
    if cache_dtype not in _CACHE_DTYPES:
        raise TypeError(f"kv_cache_dtype must be a float dtype or int8, got {cache_dtype}")
    if cache_dtype == torch.int8:
        if k_scale is None or v_scale is None:
            raise ValueError("an int8 main cache needs k_scale and v_scale")
        _check_scale("k_scale", k_scale, kv, h, dev)
        _check_scale("v_scale", v_scale, kv, h, dev)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(
            f"k_scale/v_scale are only for an int8 cache (cache dtype is {cache_dtype})"
        )

    # auxiliary K/V
    if selected_kv_source == "auxiliary":
        if auxiliary_key is None:
            raise ValueError("selected_kv_source='auxiliary' needs auxiliary_key [B, KV, A, H]")
        check_tensor(
            "auxiliary_key",
            auxiliary_key,
            dtypes=_FLOATS,
            shape=(b, kv, None, h),
            device=dev,
            contiguous_last=True,
        )
        if auxiliary_kv_shared:
            if auxiliary_value is not None:
                raise ValueError(
                    "auxiliary_kv_shared=True uses auxiliary_key as V; auxiliary_value must be None"
                )
        else:
            if auxiliary_value is None:
                raise ValueError("auxiliary_value is required unless auxiliary_kv_shared=True")
            check_tensor(
                "auxiliary_value",
                auxiliary_value,
                dtypes=_FLOATS,
                shape=tuple(auxiliary_key.shape),
                device=dev,
                contiguous_last=True,
            )
    elif auxiliary_key is not None or auxiliary_value is not None:
        raise ValueError(
            "auxiliary_key/auxiliary_value are only used with selected_kv_source='auxiliary'"
        )

    # selection
    check_tensor("selected_indices", selected_indices, dtypes=_INDEX, ndim=2, device=dev)
    if selected_indices.shape[0] != b * s:
        raise ValueError(
            f"selected_indices must have shape ({b * s}, max_selected) (rows = B*S), got {tuple(selected_indices.shape)}"
        )
    check_tensor("selected_counts", selected_counts, dtypes=_INDEX, shape=(b * s,), device=dev)

    # prologue inputs
    if do_rotary:
        if cos_cache is None or sin_cache is None:
            raise ValueError("do_rotary=True needs cos_cache and sin_cache")
        check_nonneg_int("rotary_offset", rotary_offset)
        check_rotary_caches(
            cos_cache, sin_cache, device=dev, max_dim=h - rotary_offset, dtypes=_FLOATS,
            bound=f"[2, head_size - rotary_offset] = [2, {h} - {rotary_offset}]",
        )  # fmt: skip
        if position_ids is not None:
            check_tensor("position_ids", position_ids, dtypes=_INDEX, shape=(b, s), device=dev)
    else:
        cos_cache = sin_cache = position_ids = None
    # 1-D parameters: the Triton kernels read element i at ptr + i (unit stride)
    vec = dict(dtypes=_FLOATS, device=dev, contiguous_last=True)
    q_norm_weight = _check_opt("q_norm_weight", q_norm_weight, shape=(h,), **vec)
    k_norm_weight = _check_opt("k_norm_weight", k_norm_weight, shape=(h,), **vec)
    head_sink = _check_opt("head_sink", head_sink, shape=(n,), **vec)
    scale = resolve_scale(scale, 1.0 / math.sqrt(h), "1/sqrt(H)")
    check_epsilon("qk_norm_epsilon", qk_norm_epsilon)
    if query_dtype is not None and query_dtype not in _FLOATS:
        raise TypeError(f"query_dtype must be a float dtype or None, got {query_dtype}")

    first = s == t_max
    # presents: in place when the past buffer is large enough, else new (past copied, rest 0)
    if past_key is not None and past_key.shape[2] >= t_max:
        present_key, present_value = past_key, past_value
    else:
        cap = t_max
        present_key = torch.zeros((b, kv, cap, h), dtype=cache_dtype, device=dev)
        present_value = torch.zeros((b, kv, cap, h), dtype=cache_dtype, device=dev)
        if past_key is not None:
            c = past_key.shape[2]
            present_key[:, :, :c] = past_key
            present_value[:, :, :c] = past_value

    if not isinstance(validate, bool) and validate != "off":
        raise ValueError(f'validate must be True, False or "off", got {validate!r}')
    if do_rotary and position_ids is None and t_max > cos_cache.shape[0]:
        raise ValueError(
            f"positions up to {t_max - 1} exceed the cos_cache's {cos_cache.shape[0]} rows"
        )
    if (validate != "off" or _strict_env()) and b and data_checks_allowed(seqlens_k):
        check_pos = position_ids is not None and position_ids.numel() > 0
        ranges = host_ranges(seqlens_k, *((position_ids,) if check_pos else ()))  # one sync
        lo, hi = ranges[0]
        if lo < 0 or hi >= t_max or (not first and lo + 1 < s):
            raise ValueError(
                f"seqlens_k must lie in [{0 if first else s - 1}, total_sequence_length - 1 = {t_max - 1}], "
                f"got min {lo} max {hi}"
            )
        if check_pos:
            check_position_range(*ranges[1], cos_cache.shape[0])
        strict = validate is True or _strict_env()
        if strict and check_selection:  # (max_selected = 0 included: counts checked)
            aux = selected_kv_source == "auxiliary"
            validate_selection(
                selected_indices,
                selected_counts,
                seqlens_k,
                s=s,
                is_first_prompt=first,
                source="auxiliary" if aux else "main",
                capacity=auxiliary_key.shape[2] if aux else present_key.shape[2],
                local_window_size=local_window_size,
            )

    # A window wider than the context covers every earlier position (qpos < T): the same
    # candidates as W = T, without planning (Triton) or building (torch tiers) W slots per row.
    local_window_size = min(local_window_size, t_max)
    args = (
        query,
        key,
        value,
        present_key,
        present_value,
        auxiliary_key,
        auxiliary_value,
        selected_indices,
        selected_counts,
        seqlens_k,
        cos_cache,
        sin_cache,
        None if position_ids is None else position_ids.to(torch.int64),
        head_sink,
        q_norm_weight,
        k_norm_weight,
        k_scale,
        v_scale,
        n,
        kv,
        h,
        float(scale),
        local_window_size,
        attention_mode,
        selected_kv_source,
        do_rotary,
        rotary_interleaved,
        int(rotary_offset),
        smooth_softmax,
        float(qk_norm_epsilon),
        auxiliary_kv_shared,
        first,
        t_max,
        query_dtype,
        backend,
    )
    return args, present_key, present_value
