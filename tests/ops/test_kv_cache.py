"""KV caches stored as fp32, bfloat16 or int8 rows with scales: the conversions' bounds, the C and PyTorch writes
agreeing to the bit, and paged attention on each path against a float64 reference over the dequantized cache."""
import ctypes
import math

import pytest
import torch

from specserve.ops import kernels
from specserve.ops.attention import build_attention_metadata, kv_caches, paged_attention, write_kv
from specserve.ops.kv_cache import (INT8_GROUP, KV_CODES, decode, encode, kv_storage_dtype, quantize_int8,
                                    round_trip, row_bytes, row_width)
from tests.kernel_support import requires_c_kernels
from tests.ops.test_attention import _dense

DTYPES = [torch.float32, torch.bfloat16, torch.int8]
PATHS = [False, pytest.param(True, marks=requires_c_kernels)]
BLOCK_SIZE, NUM_BLOCKS, H, HKV = 16, 128, 6, 2


@pytest.mark.parametrize("head_dim", [64, 72, 16])
def test_int8_round_trip_is_within_half_a_step_of_each_group(head_dim):
    """A scale per 16 numbers (72: four groups of 16 and one of 8; 16: one group): each group's largest |x| is stored as
    +-127, and every number comes back within half its group's step, give or take fp32 rounding: x / scale and
    q * scale each round once, by at most 2^-24 of a value up to 127 steps."""
    x = torch.randn(50, 3, head_dim, generator=torch.Generator().manual_seed(head_dim))
    x *= torch.logspace(-3, 2, 50)[:, None, None]
    x[:, :, :16] *= 8  # groups of different magnitudes within a row
    q, scale = quantize_int8(x)
    groups = -(-head_dim // INT8_GROUP)
    assert scale.shape == (50, 3, groups)
    back = decode(encode(x, torch.int8), head_dim, torch.float32)
    per_number = scale.repeat_interleave(INT8_GROUP, dim=-1)[..., :head_dim]
    assert q.abs().max() <= 127
    for g in range(groups):
        group = q[..., INT8_GROUP * g:INT8_GROUP * (g + 1)]
        assert torch.equal(group.abs().amax(-1), torch.full_like(scale[..., g], 127, dtype=torch.int8))
    assert ((back - x).abs() <= per_number * (0.5 + 2 * 127 * 2.0 ** -24)).all()
    torch.testing.assert_close(back, q.float() * per_number, rtol=0, atol=0)


def test_bfloat16_round_trip_is_within_half_an_ulp():
    x = torch.randn(100, 2, 32) * 10
    back = round_trip(x, torch.bfloat16)
    assert ((back - x).abs() <= x.abs() * 2.0 ** -8).all()


def test_an_all_zero_row_stays_zero():
    x = torch.zeros(2, 1, 16)
    x[1, 0, 3] = -2.5
    back = round_trip(x, torch.int8)
    assert torch.equal(back[0], x[0]) and back[1, 0, 3] == -2.5


def test_rows_take_fewer_bytes_than_fp32():
    assert row_bytes(64, torch.float32) == 256 and row_bytes(64, torch.bfloat16) == 128
    assert row_bytes(64, torch.int8) == 80 and row_width(64, torch.int8) == 80
    assert row_bytes(128, torch.int8) == 160 and row_width(72, torch.int8) == 72 + 20


@pytest.mark.parametrize("bad", ["fp8", "float16", "", "INT8"])
def test_unknown_kv_cache_dtypes_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'bfloat16', 'int8'"):
        kv_storage_dtype(bad, torch.float32)


def _c_store(k_cache, v_cache, slot, key, value):
    """csrc/kv_copy.c's store_kv of one token (key, value: [Hkv, D])."""
    lib = kernels._lib()
    lib.store_kv.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
    lib.store_kv(k_cache.data_ptr(), v_cache.data_ptr(), KV_CODES[k_cache.dtype], slot, key.data_ptr(),
                 value.data_ptr(), key.shape[0], key.shape[1], k_cache.shape[1])


@requires_c_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 80])  # int8: one scale a row; three, the last of 16 numbers
def test_c_writes_the_bits_the_pytorch_path_writes(dtype, head_dim):
    shape = (4, BLOCK_SIZE, HKV, head_dim)
    (k_torch, v_torch), = kv_caches(shape, dtype, 1)
    (k_c, v_c), = kv_caches(shape, dtype, 1)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(20, HKV, head_dim, generator=g) * 3
    v = torch.randn(20, HKV, head_dim, generator=g)
    k[:, :, :8] *= 10  # groups of different magnitudes
    k[5] = 0.0  # an all-zero row
    slots = torch.randperm(4 * BLOCK_SIZE, generator=g)[:20]
    write_kv(k_torch, v_torch, k, v, slots)
    for i, slot in enumerate(slots.tolist()):
        _c_store(k_c, v_c, slot, k[i].contiguous(), v[i].contiguous())
    assert torch.equal(_bits(k_c), _bits(k_torch)) and torch.equal(v_c.view(torch.uint8), v_torch.view(torch.uint8))


def _bits(k_cache):
    """A key cache's bytes as stored ([num_blocks, Hkv, R, block_size])."""
    return k_cache.permute(0, 2, 3, 1).contiguous().view(torch.uint8)


class _Filled:
    """A cache of `dtype` holding each request's context before this step, the step's queries and K/V."""

    def __init__(self, dtype, query_lens, context_lens, head_dim=64, block_size=BLOCK_SIZE, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.query_lens, self.context_lens, self.block_size, self.head_dim = query_lens, context_lens, block_size, head_dim
        (self.k_cache, self.v_cache), = kv_caches((NUM_BLOCKS, block_size, HKV, head_dim), dtype, 1)
        perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.tables, self.slots, self.keys, self.values, used = [], [], [], [], 0
        for q_len, c_len in zip(query_lens, context_lens):
            n = -(-c_len // block_size)
            self.tables.append(perm[used:used + n])
            used += n
            self.slots.append(torch.tensor([self.tables[-1][t // block_size] * block_size + t % block_size
                                            for t in range(c_len)]))
            self.keys.append(torch.randn(c_len, HKV, head_dim, generator=g) * 2)
            self.values.append(torch.randn(c_len, HKV, head_dim, generator=g))
            before = c_len - q_len
            write_kv(self.k_cache, self.v_cache, self.keys[-1][:before], self.values[-1][:before],
                     self.slots[-1][:before])
        self.q = [torch.randn(n, H, head_dim, generator=g) for n in query_lens]

    def step(self, rows, use_kernel, window=0):
        """paged_attention over requests `rows` (their step's K/V written first): [sum of their queries, H * D]."""
        q_lens, c_lens = [self.query_lens[i] for i in rows], [self.context_lens[i] for i in rows]
        meta = build_attention_metadata(q_lens, c_lens, [self.tables[i] for i in rows], self.block_size,
                                        torch.cat([self.slots[i][c - n:] for i, n, c in zip(rows, q_lens, c_lens)]),
                                        use_kernel)
        k = torch.cat([self.keys[i][c - n:] for i, n, c in zip(rows, q_lens, c_lens)])
        v = torch.cat([self.values[i][c - n:] for i, n, c in zip(rows, q_lens, c_lens)])
        q = torch.cat([self.q[i] for i in rows])
        return paged_attention(q, k, v, self.k_cache, self.v_cache, meta, 1 / math.sqrt(self.head_dim), window)

    def reference(self, i, window=0):
        """float64 attention of request i over the cache's dequantized contents (after a step wrote its K/V)."""
        ctx, bs = self.slots[i], self.block_size
        k = decode(self.k_cache[ctx // bs, ctx % bs], self.head_dim, torch.float64)
        v = decode(self.v_cache.view(-1, HKV, self.v_cache.shape[-1])[ctx], self.head_dim, torch.float64)
        return _dense(self.q[i].double(), k, v, 1 / math.sqrt(self.head_dim), window)

    def check(self, out, window=0):
        """out of a step over every request against the references: fp32 arithmetic over the stored numbers,
        within 2e-5 of float64 on outputs of size ~1."""
        refs = torch.cat([self.reference(i, window) for i in range(len(self.query_lens))])
        torch.testing.assert_close(out.double(), refs, atol=2e-5, rtol=2e-5)


CASES = [([1, 3, 1], [40, 19, 200]), ([20, 1], [20, 150]), ([5], [300])]  # decode, verify, prefill chunks


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lens,context_lens", CASES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (32, 16), (128, 16), (16, 16), (48, 16), (80, 16),
                                                 (64, 4)])  # vector paths, then scalar ones (int8 at 48 and 80)
def test_attention_matches_float64_over_the_dequantized_cache(dtype, use_kernel, query_lens, context_lens, head_dim,
                                                              block_size):
    filled = _Filled(dtype, query_lens, context_lens, head_dim, block_size)
    filled.check(filled.step(range(len(query_lens)), use_kernel))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fresh_prefill_reads_its_keys_as_the_cache_gives_them_back(dtype):
    """The PyTorch path attends over a prompt's own K/V without reading the cache: rounded as stored."""
    filled = _Filled(dtype, [40], [40])
    filled.check(filled.step([0], use_kernel=False))


@pytest.mark.parametrize("use_kernel", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [6, 37])
def test_sliding_windows_read_each_dtype(dtype, use_kernel, window):
    filled = _Filled(dtype, [1, 4], [90, 50])
    filled.check(filled.step([0, 1], use_kernel, window), window)


@requires_c_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (48, 16)])  # vector, scalar paths
def test_kernel_rows_are_bitwise_the_same_alone_and_in_a_batch(dtype, head_dim, block_size):
    """What lets a verification step stand for plain decoding on a quantized cache too (invariant 7)."""
    filled = _Filled(dtype, [1, 4, 1], [130, 90, 33], head_dim, block_size, seed=5)
    batch = filled.step([0, 1, 2], use_kernel=True)
    start = 0
    for i, q_len in enumerate([1, 4, 1]):
        assert torch.equal(filled.step([i], use_kernel=True), batch[start:start + q_len])
        start += q_len


@requires_c_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_c_and_pytorch_paths_agree(dtype):
    filled = _Filled(dtype, [1, 9, 30], [100, 60, 30], seed=2)
    torch.testing.assert_close(filled.step([0, 1, 2], True), filled.step([0, 1, 2], False), atol=2e-5, rtol=2e-5)
