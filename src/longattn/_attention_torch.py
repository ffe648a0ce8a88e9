"""Pure-PyTorch attention pieces shared by the torch tiers (reference / chunked) of the ops.

Used by GroupQueryAttention and meant for PagedAttention and DynamicSparseAttention too:

- KV-cache conversion: :func:`to_cache` (round / quantize once into the cache dtype) and
  :func:`from_cache` (read back, dequantized, in the compute dtype). Int8 scales are fp32
  per-tensor ``[1]`` or per-channel ``[KV, 1, H]``; ``kv_axis`` says where the KV-head axis of the
  cache tensor is (``-3`` for BNSH ``[B, KV, T, H]``, ``-2`` for paged ``[blocks, bs, KV, H]``).
- The new-token prologue: :func:`rotary_tables` + :func:`qk_prologue` (QK-norm then rotary, in the
  compute dtype) and :func:`append_rows` (write rows of a contiguous BNSH cache, sync-free).
- Attention cores over a BNSH cache: :func:`attention_unfused` (materializes the scores; the
  reference) and :func:`attention_online` (online softmax over key chunks and query blocks; the
  chunked tier), plus :func:`merge_partials` (log-sum-exp merge of partial results).

Conventions of the cores: ``q [B, S, N, H]`` in the compute dtype (fp32, or fp64 for an oracle),
``k/v [B, KV, T, H]`` in the cache dtype (float or int8 with scales), query head ``n`` reads KV
head ``n // (N // KV)``. Key ``j`` is visible to query row ``(b, s)`` iff
``0 <= qpos[b, s] < total_len[b]`` (the row is real, not padding), ``j <= qpos[b, s]`` (causal),
``j > qpos[b, s] - window`` (when ``window > 0``) and ``extra_mask`` (when given) allows it.
Logits: ``scale * q.k``, softcap ``c * tanh(x / c)``, ``+ bias``, mask, softmax with an optional
per-head ``sink`` logit in the denominator. Rows with nothing visible give zeros (never NaN), and
values of keys at ``j >= total_len[b]`` are never read into the result (NaN there cannot leak).
"""

from __future__ import annotations

import torch

from ._rotary import apply_rotary, rms_norm

__all__ = [
    "append_rows",
    "contiguous_positions",
    "prepare_new_tokens",
    "split_qkv",
    "attention_online",
    "attention_unfused",
    "compute_dtype_for",
    "from_cache",
    "merge_partials",
    "qk_prologue",
    "rotary_tables",
    "scale_view",
    "sink_logits",
    "to_cache",
]

INT8_MAX = 127.0
KV_CHUNK = 1024  # keys per online-softmax step
SCORE_BUDGET = 1 << 23  # fp32 score elements per (query block x key chunk) step (~32 MiB)


def compute_dtype_for(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 when any given tensor is fp64 (test oracles), else fp32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


# ---------------------------------------------------------------------------------------------
# KV-cache conversion.


def scale_view(scale: torch.Tensor, kv_axis: int = -3) -> torch.Tensor:
    """View a per-tensor ``[1]`` or per-channel ``[KV, 1, H]`` scale so it broadcasts against a
    cache tensor whose KV-head axis is ``kv_axis`` (negative) and head channel axis is last."""
    if scale.numel() == 1:
        return scale.reshape(())
    if kv_axis >= -1:
        raise ValueError(f"kv_axis must be <= -2, got {kv_axis}")
    kv, h = scale.shape[0], scale.shape[-1]
    return scale.reshape((kv,) + (1,) * (-kv_axis - 2) + (h,))


def to_cache(
    x: torch.Tensor,
    cache_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    *,
    kv_axis: int = -3,
) -> torch.Tensor:
    """Convert float rows ``x`` to ``cache_dtype`` with one rounding.

    Float caches: round to nearest even. Int8: ``q = round_half_even(x / scale)`` clamped to
    ``[-127, 127]``, with ``x / scale`` evaluated in ``x``'s dtype (fp32 in the tiers).
    """
    if cache_dtype == torch.int8:
        if scale is None:
            raise ValueError("an int8 cache needs a scale")
        q = torch.round(x / scale_view(scale, kv_axis).to(x.dtype))
        return q.clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return x.to(cache_dtype)


def from_cache(
    rows: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    kv_axis: int = -3,
) -> torch.Tensor:
    """Cache rows (float, or int8 with ``scale``) -> ``dtype`` (exact for float caches; int8:
    ``q * scale`` in ``dtype``)."""
    if rows.dtype == torch.int8:
        if scale is None:
            raise ValueError("an int8 cache needs a scale")
        return rows.to(dtype) * scale_view(scale, kv_axis).to(dtype)
    return rows.to(dtype)


# ---------------------------------------------------------------------------------------------
# New-token prologue.


def rotary_tables(
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather cos/sin rows for ``positions [B, S]`` -> two ``[B, S, 1, rotary_dim/2]`` in ``dtype``.

    Positions are clamped into the cache (the API validates them in eager mode; under graph
    capture a bad position must not read out of bounds).
    """
    pos = positions.to(torch.int64).clamp(0, cos_cache.shape[0] - 1)
    return cos_cache[pos].to(dtype)[:, :, None, :], sin_cache[pos].to(dtype)[:, :, None, :]


def qk_prologue(
    x: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None,
    epsilon: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    interleaved: bool,
    dtype: torch.dtype,
    rotary_offset: int = 0,
) -> torch.Tensor:
    """QK-norm (if ``norm_weight [H]``) then rotary (if ``cos``) of ``x [B, S, heads, H]``, all in
    ``dtype`` from the input values (no intermediate rounding). Rotary covers channels
    ``rotary_offset .. rotary_offset + 2 * cos.shape[-1]``; the rest pass through."""
    y = x.to(dtype)
    if norm_weight is not None:
        y = rms_norm(y, norm_weight, epsilon)
    if cos is not None:
        y = apply_rotary(y, cos, sin, interleaved=interleaved, rotary_offset=rotary_offset)
    return y


def split_qkv(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    num_heads: int,
    kv_num_heads: int,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views ``q [B, S, N, H]``, ``k/v [B, S, KV, H]`` of separate or packed
    (``query [B, S, (N + 2*KV)*H]``, key/value None) activations."""
    b, s = query.shape[:2]
    n, kv, h = num_heads, kv_num_heads, head_size
    if key is None:
        q, k, v = query.split((n * h, kv * h, kv * h), dim=-1)
    else:
        q, k, v = query, key, value
    return q.unflatten(-1, (n, h)), k.unflatten(-1, (kv, h)), v.unflatten(-1, (kv, h))


def contiguous_positions(
    seqlens_k: torch.Tensor, s: int, is_first_prompt: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qpos [B, S], total_len [B])`` int64 from ``seqlens_k`` (total length minus one).

    First prompt: ``qpos = s`` (rows ``s >= total_len[b]`` are right padding). Otherwise
    ``qpos = total_len[b] - S + s``.
    """
    total_len = seqlens_k.to(torch.int64) + 1
    ar = torch.arange(s, device=seqlens_k.device, dtype=torch.int64)
    if is_first_prompt:
        qpos = ar.expand(total_len.shape[0], s)
    else:
        qpos = total_len[:, None] - s + ar
    return qpos, total_len


def prepare_from_params(query, key, value, present_key, present_value, seqlens_k, p, *, dtype):
    """``prepare_new_tokens`` for an op's params object (GQA's or DSA's fields: num_heads,
    kv_num_heads, head_size, is_first_prompt, do_rotary, cos/sin_cache, position_ids,
    rotary_interleaved, optional rotary_offset, q/k_norm_weight, qk_norm_epsilon, k/v_scale):
    split the (packed) QKV, derive the rows' positions from seqlens_k, prepare Q and append the
    new K/V. Returns ``(q [B, S, N, H] in dtype, qpos [B, S] int64, total_len [B] int64)``."""
    q, k, v = split_qkv(query, key, value, p.num_heads, p.kv_num_heads, p.head_size)
    qpos, total_len = contiguous_positions(seqlens_k, query.shape[1], p.is_first_prompt)
    qf = prepare_new_tokens(
        q, k, v, present_key, present_value, qpos, total_len, dtype=dtype,
        cos_cache=p.cos_cache if p.do_rotary else None,
        sin_cache=p.sin_cache if p.do_rotary else None, position_ids=p.position_ids,
        interleaved=p.rotary_interleaved, rotary_offset=getattr(p, "rotary_offset", 0),
        q_norm_weight=p.q_norm_weight, k_norm_weight=p.k_norm_weight, epsilon=p.qk_norm_epsilon,
        k_scale=p.k_scale, v_scale=p.v_scale,
    )  # fmt: skip
    return qf, qpos, total_len


def prepare_new_tokens(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    present_key: torch.Tensor,
    present_value: torch.Tensor,
    qpos: torch.Tensor,
    total_len: torch.Tensor,
    *,
    dtype: torch.dtype,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
    rotary_offset: int = 0,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The shared prologue: QK-norm + rotary of Q and the new K in ``dtype``, append K (rounded
    or quantized once) and raw V to the contiguous BNSH caches at rows ``qpos`` of real rows.

    q ``[B, S, N, H]``, k/v ``[B, S, KV, H]`` activations; rotary position = ``position_ids``
    if given else ``qpos``. Returns the prepared query ``[B, S, N, H]`` in ``dtype`` (not
    rounded).
    """
    cos = sin = None
    if cos_cache is not None:
        pos = qpos if position_ids is None else position_ids
        cos, sin = rotary_tables(cos_cache, sin_cache, pos, dtype)
    common = dict(
        epsilon=epsilon,
        cos=cos,
        sin=sin,
        interleaved=interleaved,
        dtype=dtype,
        rotary_offset=rotary_offset,
    )
    qf = qk_prologue(q, norm_weight=q_norm_weight, **common)
    kf = qk_prologue(k, norm_weight=k_norm_weight, **common)
    real = (qpos >= 0) & (qpos < total_len[:, None])
    k_rows = to_cache(kf.transpose(1, 2), present_key.dtype, k_scale)  # [B, KV, S, H]
    v_rows = to_cache(v.to(dtype).transpose(1, 2), present_value.dtype, v_scale)
    append_rows(present_key, k_rows, qpos, real)
    append_rows(present_value, v_rows, qpos, real)
    return qf


def append_rows(
    cache: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor
) -> None:
    """Write ``rows [B, KV, S, H]`` (cache dtype) into ``cache [B, KV, C, H]`` at rows
    ``pos [B, S]`` where ``valid [B, S]``; other rows keep their bits.

    Sync-free: invalid rows, and rows whose position lies outside ``[0, C)`` (metadata that was
    not validated), write back the value they read (their positions are clamped into the
    cache). Valid positions of one sequence must be distinct.
    """
    b = rows.shape[0]
    view = cache.transpose(1, 2)  # [B, C, KV, H], shares cache's storage
    bi = torch.arange(b, device=pos.device)[:, None].expand(pos.shape)
    valid = valid & (pos >= 0) & (pos < cache.shape[2])
    pi = pos.clamp(0, cache.shape[2] - 1)
    new = rows.transpose(1, 2)  # [B, S, KV, H]
    # (index_put_ rather than scatter_: CPU scatter_ on bf16 rewrites the whole tensor.)
    view.index_put_((bi, pi), torch.where(valid[:, :, None, None], new, view[bi, pi]))


# ---------------------------------------------------------------------------------------------
# Attention cores.


def _heads5(t: torch.Tensor | None, kv: int, group: int) -> torch.Tensor | None:
    """[B|1, N|1, S, T] -> [B|1, KV|1, G|1, S, T] (a view) for scores laid out by KV group."""
    if t is None:
        return None
    if t.shape[1] == 1:
        return t[:, :, None]
    return t.unflatten(1, (kv, group))


def _visible(
    qpos: torch.Tensor,
    total_len: torch.Tensor,
    j0: int,
    j1: int,
    window: int,
    causal: bool,
) -> torch.Tensor:
    """bool [B, S, j1 - j0]: key j (j0 <= j < j1) visible to row (b, s) (see module doc)."""
    j = torch.arange(j0, j1, device=qpos.device, dtype=torch.int64)
    qp = qpos[:, :, None]
    tl = total_len[:, None, None]
    ok = (qp >= 0) & (qp < tl) & (j < tl)
    if causal:
        ok = ok & (j <= qp)
    if window > 0:
        ok = ok & (j > qp - window)
    return ok


def _block_logits(
    q5: torch.Tensor,
    k: torch.Tensor,
    visible: torch.Tensor,
    *,
    scale: float,
    softcap: float,
    bias5: torch.Tensor | None,
    mask5: torch.Tensor | None,
) -> torch.Tensor:
    """Masked logits [B, KV, G, S, Tc]; q5 [B, KV, G, S, H], k [B, KV, Tc, H] (compute dtype)."""
    b, kv, g, s, h = q5.shape
    tc = k.shape[2]
    x = torch.matmul(q5.reshape(b, kv, g * s, h), k.transpose(-1, -2)).view(b, kv, g, s, tc)
    x = x * scale
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    if bias5 is not None:
        x = x + bias5.to(x.dtype)
    ok = visible[:, None, None]
    if mask5 is not None:
        ok = ok & mask5
    return torch.where(ok, x, torch.full((), float("-inf"), dtype=x.dtype, device=x.device))


def _sink5(sink: torch.Tensor | None, kv: int, group: int, dtype) -> torch.Tensor | None:
    """[N] -> [1, KV, G, 1] (per-row sink logit)."""
    if sink is None:
        return None
    return sink.to(dtype).reshape(1, kv, group, 1)


def sink_logits(
    head_sink: torch.Tensor | None, smooth_softmax: bool, num_heads: int, device
) -> torch.Tensor | None:
    """The per-head sink logit: ``head_sink [N]`` when given (it implies a sink whatever
    ``smooth_softmax`` says), else a zero logit per head with ``smooth_softmax``, else None."""
    if head_sink is not None:
        return head_sink
    if smooth_softmax:
        return torch.zeros(num_heads, dtype=torch.float32, device=device)
    return None


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _to_bsnh(o5: torch.Tensor) -> torch.Tensor:
    """[B, KV, G, S, X...] -> [B, S, N, X...]."""
    o5 = o5.movedim(3, 1)
    return o5.flatten(2, 3)


def _zero_masked_values(v: torch.Tensor, total_len: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
    """Zero value rows j >= total_len[b] so a NaN there cannot leak through p = 0 (0 * NaN)."""
    j = torch.arange(j0, j1, device=v.device, dtype=torch.int64)
    ok = j[None, :] < total_len[:, None]  # [B, Tc]
    return torch.where(ok[:, None, :, None], v, torch.zeros((), dtype=v.dtype, device=v.device))


def attention_unfused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qpos: torch.Tensor,
    total_len: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = -1,
    causal: bool = True,
    softcap: float = 0.0,
    bias: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    extra_mask: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Readable attention over the whole cache at once (materializes ``[B, N, S, T]`` scores).

    Args:
        q: ``[B, S, N, H]`` in the compute dtype (fp32 or fp64).
        k, v: ``[B, KV, T, H]`` cache rows (float, or int8 with ``k_scale``/``v_scale``).
        qpos: ``[B, S]`` int64 query positions; total_len: ``[B]`` int64 valid keys per sequence.
        bias: optional ``[B|1, N|1, S, T' >= T]`` added after softcap (first T columns used).
        sink: optional ``[N]`` sink logits (joins the denominator, no value).
        extra_mask: optional bool ``[B|1, N|1, S, T' >= T]``, ANDed with the visibility rule.

    Returns:
        ``out [B, S, N, H]`` in q's dtype, and with ``return_lse`` also ``lse [B, S, N]``
        (log of the softmax denominator incl. the sink; ``-inf`` for empty rows).
    """
    b, s, n, h = q.shape
    kv, t = k.shape[1], k.shape[2]
    g = n // kv
    dt = q.dtype
    q5 = q.view(b, s, kv, g, h).permute(0, 2, 3, 1, 4)  # [B, KV, G, S, H]
    kf = from_cache(k, k_scale, dtype=dt)  # [B, KV, T, H]
    vf = _zero_masked_values(from_cache(v, v_scale, dtype=dt), total_len, 0, t)
    bias5 = _heads5(None if bias is None else bias[..., :t], kv, g)
    mask5 = _heads5(None if extra_mask is None else extra_mask[..., :t], kv, g)
    vis = _visible(qpos, total_len, 0, t, window, causal)
    x = _block_logits(q5, kf, vis, scale=scale, softcap=softcap, bias5=bias5, mask5=mask5)
    m = x.amax(-1)  # [B, KV, G, S]
    sink5 = _sink5(sink, kv, g, dt)
    if sink5 is not None:
        m = torch.maximum(m, sink5)
    m = _finite_or_zero(m)
    p = torch.exp(x - m[..., None])  # masked -> exp(-inf) = 0
    denom = p.sum(-1)
    if sink5 is not None:
        denom = denom + torch.exp(sink5 - m)
    o = torch.matmul(p.reshape(b, kv, g * s, t), vf).view(b, kv, g, s, h)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    o = torch.where((denom > 0)[..., None], o / safe[..., None], torch.zeros_like(o))
    out = _to_bsnh(o)
    if not return_lse:
        return out
    lse = torch.where(denom > 0, m + torch.log(safe), torch.full_like(m, float("-inf")))
    return out, _to_bsnh(lse)


def attention_online(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qpos: torch.Tensor,
    total_len: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = -1,
    causal: bool = True,
    softcap: float = 0.0,
    bias: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    extra_mask: torch.Tensor | None = None,
    qpos_offsets: tuple[int, int] | None = None,
    kv_chunk: int | None = None,
    return_lse: bool = False,
):
    """Same result as :func:`attention_unfused`, memory-efficient: online softmax (running max
    and sum in the compute dtype) over key chunks of ``kv_chunk`` keys, query rows in blocks so a
    step's scores stay within ``SCORE_BUDGET`` elements; K/V chunks are dequantized on the fly.

    ``qpos_offsets = (lo, hi)`` (host ints) promises ``s + lo <= qpos[b, s] <= s + hi`` for
    every real row; the loop then skips key chunks no row of a query block can see (causal /
    window). Without it every chunk is visited. No host synchronization.
    """
    b, s, n, h = q.shape
    kv, t = k.shape[1], k.shape[2]
    g = n // kv
    dt = q.dtype
    chunk = max(1, kv_chunk or KV_CHUNK)
    q_block = max(1, min(s, SCORE_BUDGET // max(1, b * n * min(chunk, max(t, 1)))))
    out = q.new_zeros((b, s, n, h))
    lse_out = q.new_full((b, s, n), float("-inf")) if return_lse else None
    sink5 = _sink5(sink, kv, g, dt)
    for s0 in range(0, s, q_block):
        s1 = min(s, s0 + q_block)
        q5 = q[:, s0:s1].reshape(b, s1 - s0, kv, g, h).permute(0, 2, 3, 1, 4)
        qp = qpos[:, s0:s1]
        bias_b = None if bias is None else _heads5(bias[..., s0:s1, :], kv, g)
        mask_b = None if extra_mask is None else _heads5(extra_mask[..., s0:s1, :], kv, g)
        lo, hi = 0, t
        if qpos_offsets is not None and causal:
            hi = min(t, s1 - 1 + qpos_offsets[1] + 1)
            if window > 0:
                lo = max(0, s0 + qpos_offsets[0] - window + 1)
        m = torch.full((b, kv, g, s1 - s0), float("-inf"), dtype=dt, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros((b, kv, g, s1 - s0, h), dtype=dt, device=q.device)
        for j0 in range(lo, hi, chunk):
            j1 = min(hi, j0 + chunk)
            kc = from_cache(k[:, :, j0:j1], k_scale, dtype=dt)
            vc = _zero_masked_values(
                from_cache(v[:, :, j0:j1], v_scale, dtype=dt), total_len, j0, j1
            )
            vis = _visible(qp, total_len, j0, j1, window, causal)
            x = _block_logits(
                q5,
                kc,
                vis,
                scale=scale,
                softcap=softcap,
                bias5=None if bias_b is None else bias_b[..., j0:j1],
                mask5=None if mask_b is None else mask_b[..., j0:j1],
            )
            m_new = torch.maximum(m, x.amax(-1))
            m_safe = _finite_or_zero(m_new)
            alpha = torch.exp(m - m_safe)  # m = -inf -> 0
            p = torch.exp(x - m_safe[..., None])
            l = l * alpha + p.sum(-1)
            pv = torch.matmul(p.reshape(b, kv, g * (s1 - s0), j1 - j0), vc)
            acc = acc * alpha[..., None] + pv.view(acc.shape)
            m = m_new
        if sink5 is not None:
            m_new = torch.maximum(m, sink5)
            m_safe = _finite_or_zero(m_new)
            alpha = torch.exp(m - m_safe)
            l = l * alpha + torch.exp(sink5 - m_safe)
            acc = acc * alpha[..., None]
            m = m_new
        m_safe = _finite_or_zero(m)
        ok = l > 0
        safe = torch.where(ok, l, torch.ones_like(l))
        o = torch.where(ok[..., None], acc / safe[..., None], torch.zeros_like(acc))
        out[:, s0:s1] = _to_bsnh(o)
        if lse_out is not None:
            lse = torch.where(ok, m_safe + torch.log(safe), torch.full_like(m, float("-inf")))
            lse_out[:, s0:s1] = _to_bsnh(lse)
    return (out, lse_out) if return_lse else out


def merge_partials(
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention results over disjoint key sets by log-sum-exp.

    ``outs[i] [..., N, H]`` (normalized over key set i), ``lses[i] [..., N]`` (``-inf`` for an
    empty part, computed with no sink); ``sink [N]`` optionally joins the merged denominator.
    Returns ``(out [..., N, H], lse [..., N])``; rows empty in every part (and no sink) give 0.
    """
    lse = torch.stack(lses)  # [P, ..., N]
    m = lse.amax(0)
    if sink is not None:
        m = torch.maximum(m, sink.to(m.dtype))
    m_safe = _finite_or_zero(m)
    w = torch.exp(lse - m_safe)  # [P, ..., N]
    denom = w.sum(0)
    if sink is not None:
        denom = denom + torch.exp(sink.to(m.dtype) - m_safe)
    num = sum(
        torch.where(wi[..., None] > 0, wi[..., None] * oi, torch.zeros_like(oi))
        for wi, oi in zip(w, outs)
    )
    ok = denom > 0
    safe = torch.where(ok, denom, torch.ones_like(denom))
    out = torch.where(ok[..., None], num / safe[..., None], torch.zeros_like(num))
    merged = torch.where(ok, m_safe + torch.log(safe), torch.full_like(m, float("-inf")))
    return out, merged
