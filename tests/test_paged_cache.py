"""PagedKVCache (allocator), reshape_and_cache, gather_paged_kv, compute_slot_mapping, and an
end-to-end decode loop through the manager against GroupQueryAttention on contiguous caches."""

from __future__ import annotations

import pytest
import torch

from longattn._rotary import rope_cache
from longattn.paged import (
    OutOfBlocksError,
    PagedKVCache,
    compute_slot_mapping,
    gather_paged_kv,
    paged_attention,
    reshape_and_cache,
)
from longattn.paged.kv import _gather_paged_kv_op, _reshape_and_cache_op

FP16, FP32 = torch.float16, torch.float32


def make_cache(num_blocks=8, block_size=4, layers=1, kv=2, h=8, dtype=FP32):
    return PagedKVCache(num_blocks, block_size, layers, kv, h, dtype=dtype, device="cpu")


# ---------------------------------------------------------------------------------------------
# PagedKVCache.


def test_allocation_and_block_boundaries():
    cache = make_cache(num_blocks=8, block_size=4)
    cache.add_sequence("a")
    cache.add_sequence("b")
    assert cache.num_free_blocks == 8
    step = cache.extend(["a", "b"], [3, 5])
    assert cache.blocks("a") == [0] and cache.blocks("b") == [1, 2]
    assert step.past_seqlens.tolist() == [0, 0] and step.cu_seqlens.tolist() == [0, 3, 8]
    assert step.num_tokens == 8
    assert step.block_table.dtype == torch.int32 and step.block_table.tolist() == [[0, -1], [1, 2]]
    assert cache.past_seqlens(["a", "b"]).tolist() == [3, 5]
    # "a" goes from 3 to 4 tokens (fills block 0 exactly), then to 5 (a new block)
    step = cache.extend("a", 1)
    assert cache.blocks("a") == [0] and step.past_seqlens.tolist() == [3]
    assert step.slot_mapping.tolist() == [3]
    step = cache.extend("a", 1)
    assert cache.blocks("a") == [0, 3] and step.slot_mapping.tolist() == [3 * 4 + 0]
    assert cache.num_free_blocks == 4
    step = cache.extend(["b", "a"], [0, 6])  # zero new tokens is fine; crosses two boundaries
    assert cache.blocks("a") == [0, 3, 4] and cache.seqlen("a") == 11
    assert step.cu_seqlens.tolist() == [0, 0, 6] and step.past_seqlens.tolist() == [5, 5]
    assert step.block_table.tolist() == [[1, 2, -1], [0, 3, 4]]
    assert cache.block_table(["b"], max_blocks=6).tolist() == [[1, 2, -1, -1, -1, -1]]
    with pytest.raises(ValueError, match="max_blocks = 1 < 3"):
        cache.block_table(["a"], max_blocks=1)


def test_extend_takes_int_like_counts():
    """numpy integers and integer tensors count as ints; a float count is a named TypeError."""
    np = pytest.importorskip("numpy")
    cache = make_cache(num_blocks=8, block_size=4)
    cache.add_sequence("a")
    cache.add_sequence("b")
    cache.extend("a", np.int64(2))
    cache.extend("a", torch.tensor(1))
    cache.extend(["a", "b"], torch.tensor([1, 3]))
    cache.extend(["a", "b"], [np.int32(1), 2])
    assert cache.past_seqlens(["a", "b"]).tolist() == [5, 5]
    with pytest.raises(TypeError, match="num_tokens must hold ints, got float"):
        cache.extend("a", 1.0)
    assert cache.seqlen("a") == 5  # nothing changed


def test_out_of_blocks_changes_nothing():
    cache = make_cache(num_blocks=4, block_size=4)
    for s in ("a", "b"):
        cache.add_sequence(s)
    cache.extend(["a", "b"], [5, 2])  # a: 2 blocks, b: 1 block, 1 free
    before = (cache.num_free_blocks, cache.blocks("a"), cache.blocks("b"), cache.seqlen("a"),
              cache.seqlen("b"))  # fmt: skip
    with pytest.raises(OutOfBlocksError, match="needs 2 more blocks .* only 1 of 4 are free"):
        cache.extend(["a", "b"], [4, 3])  # a needs 1 (9 tokens -> 3 blocks), b needs 1 more
    after = (cache.num_free_blocks, cache.blocks("a"), cache.blocks("b"), cache.seqlen("a"),
             cache.seqlen("b"))  # fmt: skip
    assert before == after
    cache.extend(["a", "b"], [3, 2])  # fits: a -> 8 tokens (2 blocks), b -> 4 (1 block)
    assert cache.num_free_blocks == 1


def test_free_and_reuse():
    cache = make_cache(num_blocks=4, block_size=2)
    cache.add_sequence(1)
    cache.add_sequence(2)
    cache.extend([1, 2], [3, 2])
    freed = cache.blocks(1)
    cache.free(1)
    assert 1 not in cache and cache.num_free_blocks == 3
    cache.add_sequence(3)
    cache.extend(3, 4)
    assert sorted(cache.blocks(3)) == sorted(freed)
    with pytest.raises(KeyError, match="unknown sequence 1"):
        cache.extend(1, 1)
    with pytest.raises(ValueError, match="already exists"):
        cache.add_sequence(2)
    with pytest.raises(ValueError, match="distinct"):
        cache.extend([2, 2], [1, 1])
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        cache.extend(2, -1)


def test_cache_tensors():
    cache = PagedKVCache(6, 16, 2, 2, 32, dtype=torch.int8)
    assert cache.key_cache(1).shape == (6, 16, 2, 32) and cache.key_cache(1).dtype == torch.int8
    assert cache.key_cache(0) is not cache.key_cache(1)
    assert cache.key_cache(0) is not cache.value_cache(0)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache(6, 16, 2, 2, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        PagedKVCache(6, 0, 2, 2, 32)


# ---------------------------------------------------------------------------------------------
# compute_slot_mapping / reshape_and_cache / gather_paged_kv.


def test_slot_mapping_matches_the_manager():
    cache = make_cache(num_blocks=16, block_size=4)
    for s in range(3):
        cache.add_sequence(s)
    cache.extend([0, 1, 2], [5, 1, 7])
    step = cache.extend([0, 1, 2], [2, 4, 1])
    sm = compute_slot_mapping(step.cu_seqlens, step.past_seqlens, step.block_table, 4)
    assert sm.dtype == torch.int64 and torch.equal(sm, step.slot_mapping)
    table = step.block_table.clone()
    table[1, 1] = -1  # sequence 1 (tokens 2..5 at positions 1..4) loses its block of position 4
    sm = compute_slot_mapping(step.cu_seqlens, step.past_seqlens, table, 4, num_tokens=7)
    want = step.slot_mapping.tolist()
    want[5] = -1
    assert sm.tolist() == want


@pytest.mark.parametrize("cache_dtype", [FP32, FP16, "int8_tensor", "int8_channel"])
def test_reshape_and_cache(cache_dtype):
    g = torch.Generator().manual_seed(0)
    nb, bs, kv, h, t = 5, 4, 2, 8, 6
    scales = {}
    if isinstance(cache_dtype, str):
        if cache_dtype == "int8_tensor":
            scales = dict(k_scale=torch.tensor([0.02]), v_scale=torch.tensor([0.03]))
        else:
            scales = dict(k_scale=0.01 + 0.02 * torch.rand(kv, 1, h, generator=g),
                          v_scale=0.01 + 0.02 * torch.rand(kv, 1, h, generator=g))  # fmt: skip
        cache_dtype = torch.int8
        kc = torch.randint(-127, 128, (nb, bs, kv, h), generator=g, dtype=torch.int8)
    else:
        kc = torch.randn(nb, bs, kv, h, generator=g).to(cache_dtype)
    vc = kc.clone()
    key = torch.randn(t, kv * h, generator=g)
    value = torch.randn(t, kv, h, generator=g)  # the 3-D layout is accepted too
    slots = torch.tensor([7, 0, -1, 19, 12, -5])
    kc0, vc0 = kc.clone(), vc.clone()
    reshape_and_cache(key, value, kc, vc, slots, **scales)
    for cache0, cache, x, sname in ((kc0, kc, key.view(t, kv, h), "k_scale"),
                                    (vc0, vc, value, "v_scale")):  # fmt: skip
        want = cache0.flatten(0, 1).clone()
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            if cache_dtype == torch.int8:
                sc = scales[sname]
                sc = sc.reshape(()) if sc.numel() == 1 else sc.reshape(kv, h)
                want[s] = torch.round(x[i] / sc).clamp(-127, 127).to(torch.int8)
            else:
                want[s] = x[i].to(cache_dtype)
        assert torch.equal(cache.flatten(0, 1), want)


def test_reshape_and_cache_bad_input():
    kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    key = value = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 12 must be < num_blocks"):
        reshape_and_cache(key, value, kc, vc, torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="slot_mapping: several new tokens write the same"):
        reshape_and_cache(key, value, kc, vc, torch.tensor([5, 5]))
    with pytest.raises(ValueError, match=r"key must have shape \(tokens, 16\)"):
        reshape_and_cache(torch.randn(2, 12), value, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        reshape_and_cache(key, value, kc, vc, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="k_scale is required"):
        i8 = kc.to(torch.int8)
        reshape_and_cache(key, value, i8, i8.clone(), torch.tensor([0, 1]))
    # validate=False: an out-of-range slot is skipped, not written out of bounds
    reshape_and_cache(key, value, kc, vc, torch.tensor([0, 12]), validate=False)
    assert torch.equal(kc.flatten(0, 1)[0], key[0].view(2, 8)) and kc.flatten(0, 1)[1:].eq(0).all()


def _paged_fixture(cache_dtype=FP32, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb, bs, kv, h = 10, 4, 2, 8
    if cache_dtype == torch.int8:
        kc = torch.randint(-127, 128, (nb, bs, kv, h), generator=g, dtype=torch.int8)
        vc = torch.randint(-127, 128, (nb, bs, kv, h), generator=g, dtype=torch.int8)
    else:
        kc = torch.randn(nb, bs, kv, h, generator=g).to(cache_dtype)
        vc = torch.randn(nb, bs, kv, h, generator=g).to(cache_dtype)
    table = torch.tensor([[7, 2, -1], [0, 9, 4], [5, -1, -1]], dtype=torch.int32)
    seqlens = torch.tensor([6, 9, 0], dtype=torch.int32)
    return kc, vc, table, seqlens


def _manual_gather(cache, table, seqlens):
    bs = cache.shape[1]
    rows = [
        cache[table[b, j // bs], j % bs] for b in range(len(seqlens)) for j in range(seqlens[b])
    ]
    return torch.stack(rows)


def test_gather_paged_kv():
    kc, vc, table, seqlens = _paged_fixture()
    k, v = gather_paged_kv(kc, vc, table, seqlens)
    assert k.shape == (15, 2, 8) and k.dtype == FP32
    assert torch.equal(k, _manual_gather(kc, table, seqlens))
    assert torch.equal(v, _manual_gather(vc, table, seqlens))
    k4, v4 = gather_paged_kv(kc, vc, table, seqlens, num_heads=6, out_dtype=FP16, total_tokens=15)
    assert k4.shape == (15, 6, 8) and k4.dtype == FP16
    assert torch.equal(k4[:, 3], k[:, 1].half()) and torch.equal(v4[:, 2], v[:, 0].half())


@pytest.mark.parametrize("per_channel", [False, True])
def test_gather_paged_kv_int8(per_channel):
    kc, vc, table, seqlens = _paged_fixture(torch.int8)
    ks = torch.rand(2, 1, 8) + 0.01 if per_channel else torch.tensor([0.05])
    vs = torch.rand(2, 1, 8) + 0.01 if per_channel else torch.tensor([0.07])
    k, v = gather_paged_kv(kc, vc, table, seqlens, k_scale=ks, v_scale=vs)
    assert k.dtype == FP32  # int8 dequantizes to fp32 by default
    sk = ks.reshape(()) if not per_channel else ks.reshape(2, 8)
    sv = vs.reshape(()) if not per_channel else vs.reshape(2, 8)
    assert torch.equal(k, _manual_gather(kc, table, seqlens).float() * sk)
    assert torch.equal(v, _manual_gather(vc, table, seqlens).float() * sv)


def test_gather_paged_kv_bad_input():
    kc, vc, table, seqlens = _paged_fixture()
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1 must be a block index"):
        t = table.clone()
        t[0, 1] = -1
        gather_paged_kv(kc, vc, t, seqlens)
    with pytest.raises(ValueError, match=r"seqlens\[1\] = 13 tokens exceed"):
        gather_paged_kv(kc, vc, table, torch.tensor([6, 13, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="total_tokens = 14 must equal sum"):
        gather_paged_kv(kc, vc, table, seqlens, total_tokens=14)
    with pytest.raises(ValueError, match="num_heads = 3 must be a multiple"):
        gather_paged_kv(kc, vc, table, seqlens, num_heads=3)
    with pytest.raises(TypeError, match="seqlens must have dtype int32"):
        gather_paged_kv(kc, vc, table, seqlens.long())


def test_opcheck_kv_ops():
    kc, vc, table, seqlens = _paged_fixture(torch.int8)
    ks, vs = torch.tensor([0.05]), torch.rand(2, 1, 8) + 0.01
    torch.library.opcheck(_gather_paged_kv_op, (kc, vc, table, seqlens, 15, 4, ks, vs, FP16))
    key, value = torch.randn(3, 16), torch.randn(3, 16)
    slots = torch.tensor([3, -1, 17])
    torch.library.opcheck(_reshape_and_cache_op, (key, value, kc.clone(), vc.clone(), slots,
                                                  ks, vs))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# End to end: prefill + decode steps through the manager vs GQA on contiguous caches.


@pytest.mark.parametrize("cache_dtype", [FP16, torch.int8])
def test_decode_loop_matches_gqa(cache_dtype):
    from longattn.gqa import group_query_attention

    g = torch.Generator().manual_seed(7)
    n, kv, h, bs, layers = 4, 2, 32, 8, 2
    dtype = FP16
    scales = {}
    if cache_dtype == torch.int8:
        scales = dict(k_scale=torch.tensor([0.03]), v_scale=0.01 + 0.02 * torch.rand(kv, 1, h))
    cos, sin = rope_cache(64, h)
    rot = dict(do_rotary=True, cos_cache=cos, sin_cache=sin)
    cache = PagedKVCache(24, bs, layers, kv, h, dtype=cache_dtype)
    cap = 40
    contiguous = {}  # seq -> per layer (present_key, present_value) [1, KV, cap, H]
    steps = [
        ({"a": 11, "b": 3}, None),  # two prompts
        ({"a": 1, "b": 1}, None),  # decode
        ({"a": 1, "b": 1, "c": 6}, None),  # "c" joins with its prompt
        ({"a": 1, "c": 1}, "b"),  # "b" finished: freed
        ({"a": 1, "c": 1, "d": 9}, None),  # "d" reuses b's blocks
    ]
    for new, finished in steps:
        if finished is not None:
            cache.free(finished)
            del contiguous[finished]
        ids = list(new)
        for s in ids:
            if s not in cache:
                cache.add_sequence(s)
                contiguous[s] = [tuple(torch.zeros(1, kv, cap, h, dtype=cache_dtype)
                                       for _ in range(2)) for _ in range(layers)]  # fmt: skip
        step = cache.extend(ids, [new[s] for s in ids])
        for layer in range(layers):
            tokens = step.num_tokens
            q = torch.randn(tokens, n * h, generator=g).to(dtype)
            k = torch.randn(tokens, kv * h, generator=g).to(dtype)
            v = torch.randn(tokens, kv * h, generator=g).to(dtype)
            out = paged_attention(q, k, v, cache.key_cache(layer), cache.value_cache(layer),
                                  step.cu_seqlens, step.past_seqlens, step.block_table,
                                  num_heads=n, kv_num_heads=kv, **rot, **scales)  # fmt: skip
            cu, past = step.cu_seqlens.tolist(), step.past_seqlens.tolist()
            for i, s in enumerate(ids):
                t0, t1 = cu[i], cu[i + 1]
                total = past[i] + t1 - t0
                pk, pv = contiguous[s][layer]
                ref, _, _ = group_query_attention(
                    q[t0:t1][None], k[t0:t1][None], v[t0:t1][None], pk, pv,
                    seqlens_k=torch.tensor([total - 1], dtype=torch.int32),
                    total_sequence_length=total, num_heads=n, kv_num_heads=kv, **rot, **scales,
                )  # fmt: skip
                got = out[t0:t1]
                # same math on the same data: equal up to summation order (<= 1 fp16 ulp)
                diff = (got.float() - ref[0].float()).abs()
                ulp = torch.finfo(FP16).eps * ref[0].float().abs() + 2.0**-24
                assert bool((diff <= ulp).all()), f"seq {s}: max diff {float(diff.max())}"
                # the paged cache holds exactly what the contiguous one holds
                blocks = cache.blocks(s)
                slots = [blocks[j // bs] * bs + j % bs for j in range(total)]
                paged_k = cache.key_cache(layer).flatten(0, 1)[slots].transpose(0, 1)
                paged_v = cache.value_cache(layer).flatten(0, 1)[slots].transpose(0, 1)
                assert torch.equal(paged_k, pk[0, :, :total]), f"key cache of {s} differs"
                assert torch.equal(paged_v, pv[0, :, :total]), f"value cache of {s} differs"
