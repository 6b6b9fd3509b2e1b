"""The kernels' index boundary on the CPU: what the wrappers hand the kernels (runs without CUDA).

`_block_counts` tells each kernel how many slot blocks of a row to visit; a count that is one too
small drops valid slots silently, one too large only costs time. It is checked against its
definition (one more than the block of the row's last valid slot, 0 for a row with none) on drawn
rows: ``-1`` anywhere, other negative values (unused as well), widths that are not a multiple of
the block, int32 and int64. `_pad_indices` keeps every slot and pads with ``-1`` only.
`backward_choice` picks the backward the wrapper runs.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_ref.kernels.autograd import TWO_PASS_MAX_KEYS, _block_counts, _pad_indices, backward_choice


def _counts_by_definition(indices: torch.Tensor, block: int) -> torch.Tensor:
    counts = []
    for row in indices.tolist():
        valid = [j for j, v in enumerate(row) if v >= 0]
        counts.append(valid[-1] // block + 1 if valid else 0)
    return torch.tensor(counts, dtype=torch.int32)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 6), width=st.integers(0, 40), block=st.sampled_from([1, 4, 8, 32]),
       dtype=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 2**16),
       unused=st.floats(0.0, 1.0))
def test_block_counts_match_their_definition(rows, width, block, dtype, seed, unused):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 50, (rows, width), generator=g)  # [T, K]
    idx[torch.rand(rows, width, generator=g) < unused] = -1
    idx[torch.rand(rows, width, generator=g) < 0.05] = -7  # any negative value marks an unused slot
    counts = _block_counts(idx.to(dtype), block)
    assert counts.dtype == torch.int32 and counts.shape == (rows,)
    assert torch.equal(counts, _counts_by_definition(idx, block))


@settings(max_examples=30, deadline=None)
@given(width=st.integers(1, 40), multiple=st.sampled_from([1, 8, 64, 128]),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_pad_indices_keeps_slots_and_pads_with_minus_one(width, multiple, dtype):
    idx = torch.arange(3 * width).reshape(3, width) - 2  # [3, K]: -2, -1, 0, 1, ...
    padded = _pad_indices(idx, multiple, dtype)
    assert padded.dtype == dtype and padded.is_contiguous()
    assert padded.shape[1] % multiple == 0 and padded.shape[1] - width < multiple
    assert torch.equal(padded[:, :width], idx.to(dtype))
    assert (padded[:, width:] == -1).all()


@pytest.mark.parametrize("heads,num_kv,expected", [(128, 8192, "two_pass"), (128, TWO_PASS_MAX_KEYS, "two_pass"),
                                                   (256, 4096, "two_pass"), (128, TWO_PASS_MAX_KEYS + 1, "one_pass"),
                                                   (64, 8192, "one_pass"), (192, 8192, "one_pass")])
def test_backward_auto_takes_two_passes_where_measured_faster(heads, num_kv, expected):
    """128 heads (or a multiple) and at most 16384 keys: two passes; otherwise one. Explicit choices stay."""
    assert backward_choice("auto", heads, num_kv) == expected
    for explicit in ("one_pass", "two_pass"):
        assert backward_choice(explicit, heads, num_kv) == explicit
    with pytest.raises(ValueError, match="backward must be 'auto', 'one_pass' or 'two_pass', got 'fused'"):
        backward_choice("fused", heads, num_kv)


def test_a_misspelt_backward_is_named_before_anything_else():
    """On the CPU too: the error names ``backward``, not the missing GPU."""
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    q, kv, idx = torch.zeros(4, 128, 576), torch.zeros(8, 576), torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="backward must be 'auto', 'one_pass' or 'two_pass', got 'two-pass'"):
        sparse_mla_tilelang(q, kv, idx, sm_scale=0.1, backward="two-pass")
    with pytest.raises(ValueError, match="not on CUDA"):
        sparse_mla_tilelang(q, kv, idx, sm_scale=0.1, backward="two_pass")
