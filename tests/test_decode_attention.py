"""The flash-decoding kernel (cohort_grpo.kernels.decode_attention) against its plain-torch reference.

On a machine without CUDA the kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set
before triton is first imported), on float32 tensors; tolerance 1e-4 max abs throughout. Sizes
are small so the interpreter stays fast, but still span several key blocks (64 keys) and splits.
"""

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import DEVICE, kernel_module

decode_module = kernel_module("cohort_grpo.kernels.decode_attention", "_decode_split_kernel")
decode_attention_reference = decode_module.decode_attention_reference
choose_num_splits = decode_module.choose_num_splits


@pytest.fixture
def decode_attention():
    """The kernel's entry point; skips the test when triton cannot be imported."""
    pytest.importorskip("triton", reason="triton is not installed; the decode kernel cannot run")
    return decode_module.decode_attention


TOLERANCE = 1e-4  # float32 max abs


def make_inputs(positions, group, head_dim=32, kv_heads=2, rows=None, max_len=160, seed=0):
    """q [B, H, 1, D] and caches [rows, H_kv, max_len, D] of random float32 values."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(positions)
    rows = batch if rows is None else rows
    heads = kv_heads * group
    q = torch.randn(batch, heads, 1, head_dim, generator=generator)
    cache_k = torch.randn(rows, kv_heads, max_len, head_dim, generator=generator)
    cache_v = torch.randn(rows, kv_heads, max_len, head_dim, generator=generator)
    position_ids = torch.tensor(positions, dtype=torch.int64)[:, None]
    return [t.to(DEVICE) for t in (q, cache_k, cache_v, position_ids)]


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_matches_reference_across_groups_and_head_dims(decode_attention, group, head_dim):
    # cache_len 150 is not a multiple of 64; positions 0, mid-second-block and the last key; a
    # spare cache row (rows > B) that no batch row reads.
    q, cache_k, cache_v, position_ids = make_inputs([0, 77, 149], group, head_dim, rows=4)
    out = decode_attention(q, cache_k, cache_v, position_ids, cache_len=150)
    expected = decode_attention_reference(q, cache_k, cache_v, position_ids, cache_len=150)
    assert out.shape == (3, 2 * group, 1, head_dim) and out.dtype == q.dtype
    assert max_error(out, expected) <= TOLERANCE


@pytest.mark.parametrize("window", [20, 70])
def test_sliding_window(decode_attention, window):
    # Windows of 20 (inside one block) and 70 (crossing a block boundary), smaller than most
    # positions; position 5 sees fewer keys than the window.
    q, cache_k, cache_v, position_ids = make_inputs([0, 5, 100, 149], group=2)
    out = decode_attention(q, cache_k, cache_v, position_ids, cache_len=150, window=window)
    expected = decode_attention_reference(q, cache_k, cache_v, position_ids, cache_len=150, window=window)
    assert max_error(out, expected) <= TOLERANCE
    unwindowed = decode_attention_reference(q, cache_k, cache_v, position_ids, cache_len=150)
    assert max_error(out, unwindowed) > 1e-3  # the window changed the answer: it was applied


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 50])
def test_shared_prefix_keys_are_read_from_the_prefix_row(decode_attention, num_splits, window):
    # Rows 1 and 2 share row 0's first 90 keys (past a 64-key block edge); their own copies of
    # those keys hold other values, so reading them would change the answer. Row 2's position (70)
    # lies inside the prefix; row 3 shares nothing.
    q, cache_k, cache_v, position_ids = make_inputs([100, 149, 70, 120], group=2, rows=5)
    prefix_rows = torch.tensor([0, 0, 0, 3], dtype=torch.int32, device=DEVICE)
    prefix_lens = torch.tensor([0, 90, 90, 0], dtype=torch.int32, device=DEVICE)
    shared_k, shared_v = cache_k.clone(), cache_v.clone()
    shared_k[1:3, :, :90], shared_v[1:3, :, :90] = cache_k[0, :, :90], cache_v[0, :, :90]
    expected = decode_attention_reference(q, shared_k, shared_v, position_ids, cache_len=150, window=window)
    out = decode_attention(q, cache_k, cache_v, position_ids, cache_len=150, window=window,
                           prefix_rows=prefix_rows, prefix_lens=prefix_lens, num_splits=num_splits)
    assert max_error(out, expected) <= TOLERANCE
    own_copies = decode_attention(q, cache_k, cache_v, position_ids, cache_len=150, window=window)
    assert max_error(own_copies[1:3], expected[1:3]) > 1e-3  # the prefix rows were read, not the own ones
    assert max_error(own_copies[[0, 3]], expected[[0, 3]]) <= TOLERANCE

@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_counts_agree(decode_attention, num_splits):
    # 300 keys = 5 blocks: one split (direct write, no merge), two splits of three blocks each
    # (one split has only blocks past a row's position), and one block per split.
    q, cache_k, cache_v, position_ids = make_inputs([3, 130, 250, 299], group=4, max_len=320)
    out = decode_attention(q, cache_k, cache_v, position_ids, cache_len=300, num_splits=num_splits)
    expected = decode_attention_reference(q, cache_k, cache_v, position_ids, cache_len=300)
    assert max_error(out, expected) <= TOLERANCE


def test_strided_query_and_custom_scale(decode_attention):
    # q as the projection produces it: [B, 1, H, D] transposed to [B, H, 1, D], not contiguous.
    # Taking every other element of a wider projection also gives the head dim a stride of 2.
    _, cache_k, cache_v, position_ids = make_inputs([10, 90], group=7)
    wide = torch.randn(2, 1, 14, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q = wide[..., ::2].transpose(1, 2)
    assert q.shape == (2, 14, 1, 32) and not q.is_contiguous()
    out = decode_attention(q, cache_k, cache_v, position_ids, cache_len=100, scale=0.3)
    expected = decode_attention_reference(q, cache_k, cache_v, position_ids, cache_len=100, scale=0.3)
    assert max_error(out, expected) <= TOLERANCE


@pytest.mark.parametrize("window", [None, 30])
def test_invisible_keys_are_never_read(decode_attention, window):
    # A NaN value outside the row's range would reach the output (its weight is 0, and 0 * NaN is
    # NaN); a NaN key is also masked out of the scores, so the values are what this can catch.
    positions = [0, 40, 70, 130]
    q, cache_k, cache_v, position_ids = make_inputs(positions, group=2)
    expected = decode_attention_reference(q, cache_k, cache_v, position_ids, cache_len=150, window=window)
    poisoned_k, poisoned_v = cache_k.clone(), cache_v.clone()
    for row, pos in enumerate(positions):
        # NaN everywhere the row cannot see: past its position (through max_len, beyond cache_len
        # too) and, with a window, before the window's start.
        for cache in (poisoned_k, poisoned_v):
            cache[row, :, pos + 1:] = float("nan")
            if window is not None:
                cache[row, :, :max(0, pos - window + 1)] = float("nan")
    out = decode_attention(q, poisoned_k, poisoned_v, position_ids, cache_len=150, window=window)
    assert torch.isfinite(out).all()
    assert max_error(out, expected) <= TOLERANCE


def test_reference_matches_masked_sdpa():
    # The reference itself against an independent formulation: SDPA over the whole cache with a
    # boolean mask and the kv heads repeated for their query groups.
    q, cache_k, cache_v, position_ids = make_inputs([0, 50, 149], group=3)
    window = 40
    keys = torch.arange(150, device=DEVICE)
    pos = position_ids[:, :1]
    visible = (keys[None, :] <= pos) & (keys[None, :] > pos - window)
    expected = F.scaled_dot_product_attention(
        q, cache_k[:, :, :150].repeat_interleave(3, dim=1), cache_v[:, :, :150].repeat_interleave(3, dim=1),
        attn_mask=visible[:, None, None, :])
    out = decode_attention_reference(q, cache_k, cache_v, position_ids, cache_len=150, window=window)
    assert max_error(out, expected) <= TOLERANCE


def test_choose_num_splits():
    # Enough programs already (256 rows x 2 kv heads > 2 x 132): one split.
    assert choose_num_splits(512, 256, 64, 132) == 1
    # Few programs, long cache: 132 splits wanted, bounded by the 64 key blocks.
    assert choose_num_splits(2, 4096, 64, 132) == 64
    # 40 programs want ceil(264 / 40) = 7 splits of 16 blocks; 3 blocks each leaves 6 splits.
    assert choose_num_splits(40, 1024, 64, 132) == 6
    assert choose_num_splits(1, 1, 64, 132) == 1


def test_rejects_unsupported_head_dim(decode_attention):
    q, cache_k, cache_v, position_ids = make_inputs([3], group=1, head_dim=48)
    with pytest.raises(ValueError, match="head dims"):
        decode_attention(q, cache_k, cache_v, position_ids, cache_len=10)
