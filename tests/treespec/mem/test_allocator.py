"""TokenToKVPoolAllocator and ReqToTokenPool: slot hand-out, exhaustion, backup/restore."""

import pytest
import torch

from treespec.mem.allocator import OutOfKVSlots, TokenToKVPoolAllocator
from treespec.mem.req_to_token import ReqToTokenPool


def test_alloc_free_roundtrip() -> None:
    a = TokenToKVPoolAllocator(10)
    x = a.alloc(4)
    assert x.dtype == torch.int64 and len(set(x.tolist())) == 4
    assert all(1 <= s <= 10 for s in x.tolist()), "slot 0 is padding and never handed out"
    assert a.available_size() == 6
    y = a.alloc(6)
    assert set(x.tolist()) | set(y.tolist()) == set(range(1, 11))
    a.free(x)
    a.free(y)
    assert a.available_size() == 10
    assert a.alloc(0).numel() == 0


def test_exhaustion_raises_and_pool_stays_usable() -> None:
    a = TokenToKVPoolAllocator(5)
    x = a.alloc(3)
    with pytest.raises(OutOfKVSlots):
        a.alloc(3)
    assert a.available_size() == 2
    y = a.alloc(2)
    assert not set(x.tolist()) & set(y.tolist())
    a.free(torch.cat([x, y]))
    assert sorted(a.free_slots.tolist()) == list(range(1, 6))


def test_invalid_sizes() -> None:
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(0)
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(4).alloc(-1)


def test_backup_restore_discards_scratch_allocations() -> None:
    a = TokenToKVPoolAllocator(16)
    a.free(a.alloc(5)[2:])  # churn so the free list is not sorted
    before = a.free_slots.clone()
    state = a.backup_state()
    scratch = a.alloc(7)
    a.free(scratch[:2])
    a.restore_state(state)
    assert torch.equal(a.free_slots, before)
    # the next allocation hands out the same slots the scratch did (draft slots are reused by verify)
    assert torch.equal(a.alloc(7), scratch)


def test_free_accepts_int32_rows() -> None:
    a = TokenToKVPoolAllocator(8)
    pool = ReqToTokenPool(2, 8)
    r = pool.alloc()
    pool.write(r, 0, a.alloc(3))
    a.free(pool.req_to_token[r, :3])  # int32 row as the caches pass it
    assert a.available_size() == 8 and a.free_slots.dtype == torch.int64


def test_req_to_token_pool_slots() -> None:
    pool = ReqToTokenPool(2, 4)
    r0, r1 = pool.alloc(), pool.alloc()
    with pytest.raises(RuntimeError):
        pool.alloc()
    pool.write(r1, 1, torch.tensor([7, 8]))
    assert pool.read(r1, 0, 3).tolist() == [0, 7, 8]
    pool.free(r0)
    assert pool.alloc() == r0


def test_freed_slots_queue_behind_the_free_list_in_order_and_are_copied() -> None:
    """Freed slots are handed out after every slot free before them, in the order freed (as one
    concatenated list would), and a caller reusing its tensor after free changes nothing."""
    a = TokenToKVPoolAllocator(12)
    first = a.alloc(6)  # 1..6
    scratch = first[2:5].clone()
    a.free(first[:2])
    a.free(scratch)
    scratch.fill_(99)  # the caller's tensor, reused
    assert a.available_size() == 11
    assert a.alloc(6).tolist() == [7, 8, 9, 10, 11, 12]  # the untouched tail first
    assert a.alloc(3).tolist() == [1, 2, 3]  # then the freed ones, oldest first
    state = a.backup_state()
    assert a.alloc(2).tolist() == [4, 5]
    a.restore_state(state)
    assert a.free_slots.tolist() == [4, 5] and a.available_size() == 2


def test_req_to_token_writes_reach_the_table_from_any_slot_tensor():
    """On a CPU the table's write goes through a numpy view of the same memory: int64 slots (a slice of
    a verify's slots, strided, made under inference mode) land in the int32 table and read back."""
    pool = ReqToTokenPool(4, 32)
    with torch.inference_mode():
        verify_slots = torch.arange(100, 112)
        pool.write(2, 5, verify_slots[:4])
        pool.write(2, 9, verify_slots[4::3])  # strided: 104, 107, 110
    assert pool.req_to_token.dtype == torch.int32
    assert pool.read(2, 5, 12).tolist() == [100, 101, 102, 103, 104, 107, 110]
    assert pool.read(1, 0, 32).eq(0).all() and pool.read(2, 0, 5).eq(0).all()
