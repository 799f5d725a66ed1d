import numpy as np
import pytest
import torch

from treespec.attention.metadata import build_metadata
from treespec.kernels.mask_pack import (
    pack_masks,
    pack_prefix_tree_masks,
    packed_segment_indptr,
    segment_packbits,
    segment_packbits_numpy,
    segment_packbits_torch,
    segment_packbits_triton,
    segment_unpackbits,
    segment_unpackbits_torch,
)


def random_segments(generator: torch.Generator, num_segments: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(0, max_len, (num_segments,), generator=generator)
    indptr = torch.zeros(num_segments + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=indptr[1:])
    mask = torch.rand(int(indptr[-1]), generator=generator) < 0.5
    return mask, indptr


def test_hand_checked_little_bit_order():
    # segment 0: 10 elements -> 2 bytes; segment 1: 3 elements -> 1 byte
    seg0 = [1, 0, 0, 0, 0, 0, 0, 1, 0, 1]  # byte 0: bits 0 and 7 -> 0x81; byte 1: bit 1 -> 0x02
    seg1 = [0, 1, 1]  # bits 1, 2 -> 0x06
    mask = torch.tensor(seg0 + seg1, dtype=torch.bool)
    indptr = torch.tensor([0, 10, 13])
    packed, packed_indptr = segment_packbits(mask, indptr)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [0x81, 0x02, 0x06]
    assert packed_indptr.tolist() == [0, 2, 3]
    assert segment_unpackbits(packed, packed_indptr, indptr).tolist() == mask.tolist()


def test_tree_mask_row_major_example():
    # one request, 2 query rows x 3 kv columns, row-major: [[1,1,0],[1,0,1]] -> bits 0,1,3,5 -> 0x2B
    mask = torch.tensor([1, 1, 0, 1, 0, 1], dtype=torch.bool)
    packed, packed_indptr = segment_packbits(mask, torch.tensor([0, 6], dtype=torch.int32))
    assert packed.tolist() == [0x2B]
    assert packed_indptr.tolist() == [0, 1]
    assert packed_indptr.dtype == torch.int32


def test_round_trip_and_empty_segments():
    generator = torch.Generator().manual_seed(0)
    for num_segments in (1, 3, 17):
        mask, indptr = random_segments(generator, num_segments, 70)
        packed, packed_indptr = segment_packbits_torch(mask, indptr)
        assert packed.numel() == int(((indptr[1:] - indptr[:-1] + 7) // 8).sum())
        assert torch.equal(packed_indptr, packed_segment_indptr(indptr))
        assert torch.equal(segment_unpackbits(packed, packed_indptr, indptr), mask)


def test_triton_matches_torch(triton_device: str):
    generator = torch.Generator().manual_seed(1)
    for num_segments, max_len in ((1, 9), (4, 300), (6, 2000)):
        mask, indptr = random_segments(generator, num_segments, max_len)
        expected = segment_packbits_torch(mask, indptr)
        got = [t.cpu() for t in segment_packbits_triton(mask.to(triton_device), indptr.to(triton_device))]
        assert torch.equal(got[0], expected[0])
        assert torch.equal(got[1], expected[1])


def test_numpy_path_matches_torch_reference():
    """segment_packbits / segment_unpackbits on CPU go through numpy; the torch reference decides."""
    generator = torch.Generator().manual_seed(2)
    for num_segments, max_len in ((1, 1), (5, 40), (9, 300)):
        mask, indptr = random_segments(generator, num_segments, max_len)
        expected_packed, expected_indptr = segment_packbits_torch(mask, indptr)
        packed, packed_indptr = segment_packbits_numpy(mask, indptr)
        assert torch.equal(packed, expected_packed) and torch.equal(packed_indptr, expected_indptr)
        assert torch.equal(segment_unpackbits(packed, packed_indptr, indptr),
                           segment_unpackbits_torch(packed, packed_indptr, indptr))


def test_pack_masks_keeps_requests_byte_aligned():
    # 2x3 (6 bits -> 1 byte) then 3x5 (15 bits -> 2 bytes): request 1 starts at byte 1, not bit 6
    first = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    second = torch.rand(3, 5, generator=torch.Generator().manual_seed(3)) < 0.5
    packed, packed_indptr = pack_masks([first, second])
    assert packed_indptr.tolist() == [0, 1, 3] and packed_indptr.dtype == torch.int32
    assert packed[0] == 0x2B
    bits = segment_unpackbits(packed, packed_indptr, torch.tensor([0, 6, 21]))
    assert torch.equal(bits, torch.cat([first.flatten(), second.flatten()]))
    empty_packed, empty_indptr = pack_masks([])
    assert empty_packed.numel() == 0 and empty_indptr.tolist() == [0]


def test_metadata_unpacked_mask_is_the_row_major_concatenation():
    """AttentionMetadata packs per-request masks and hands back the flat boolean mask FlashInfer takes."""
    generator = torch.Generator().manual_seed(4)
    qo_lens, kv_lens = [3, 1, 4], [10, 6, 13]
    masks = [torch.rand(q, k, generator=generator) < 0.5 for q, k in zip(qo_lens, kv_lens, strict=True)]
    slots = [torch.arange(k) for k in kv_lens]
    meta = build_metadata(qo_lens, slots, masks)
    assert meta.mask_indptr.tolist() == [0, 4, 5, 12]  # ceil(30/8), ceil(6/8), ceil(52/8) bytes
    assert meta.mask_bit_indptr().tolist() == [0, 30, 36, 88]
    assert torch.equal(meta.unpacked_mask(), torch.cat([m.flatten() for m in masks]))
    assert build_metadata(qo_lens, slots).unpacked_mask() is None


def test_prefix_tree_masks_pack_as_the_full_masks_do():
    """pack_prefix_tree_masks (the tree verify's host path) gives pack_masks' bytes and offsets for the
    masks it stands for: every node sees the whole prefix, then its tree row; lone roots, empty
    prefixes and segments that end mid-byte included."""
    generator = torch.Generator().manual_seed(5)
    prefix_lens, sizes = [0, 7, 1, 13, 30, 2], [3, 1, 5, 1, 8, 2]
    trees = [torch.rand(s, s, generator=generator) < 0.5 for s in sizes]
    for tree in trees:
        tree.fill_diagonal_(True)
    trees[1][0, 0] = trees[3][0, 0] = True
    full = [torch.cat([torch.ones(s, p, dtype=torch.bool), t], dim=1)
            for p, s, t in zip(prefix_lens, sizes, trees, strict=True)]
    packed, indptr = pack_prefix_tree_masks(prefix_lens, [np.asarray(t.numpy()) for t in trees])
    expected, expected_indptr = pack_masks(full)
    assert torch.equal(packed, expected) and torch.equal(indptr, expected_indptr)
    assert indptr.dtype == torch.int32 and packed.dtype == torch.uint8
    # handed to build_metadata packed, they read back as the full masks
    meta = build_metadata(sizes, [torch.arange(p + s) for p, s in zip(prefix_lens, sizes, strict=True)],
                          packed_masks=(packed, indptr))
    assert torch.equal(meta.unpacked_mask(), torch.cat([m.flatten() for m in full]))
    with pytest.raises(ValueError, match="not both"):
        build_metadata(sizes, [torch.arange(p + s) for p, s in zip(prefix_lens, sizes, strict=True)], full,
                       packed_masks=(packed, indptr))
