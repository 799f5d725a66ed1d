import torch

from treespec.kernels import assign_draft_cache_locs
from treespec.kernels.cache_locs import (
    assign_req_to_token_pool_torch,
    assign_req_to_token_pool_triton,
    create_flashinfer_kv_indices,
    create_flashinfer_kv_indices_torch,
    create_flashinfer_kv_indices_triton,
)


def random_batch(generator: torch.Generator, bs: int, max_len: int):
    req_to_token = torch.randint(0, 10_000, (bs + 3, 96), dtype=torch.int32, generator=generator)
    req_pool_indices = torch.randperm(bs + 3, generator=generator)[:bs]
    start = torch.randint(0, 40, (bs,), generator=generator)
    end = start + torch.randint(0, max_len, (bs,), generator=generator)
    return req_to_token, req_pool_indices, start, end


def python_assign(req_to_token, req_pool_indices, start, end, out_cache_loc):
    offset = 0
    for row, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist(), strict=True):
        req_to_token[row, s:e] = out_cache_loc[offset : offset + e - s].to(torch.int32)
        offset += e - s


def test_assign_req_to_token_pool_torch_and_triton(triton_device: str):
    generator = torch.Generator().manual_seed(0)
    for bs, max_len in ((1, 5), (4, 40), (7, 56)):
        req_to_token, req_pool_indices, start, end = random_batch(generator, bs, max_len)
        out_cache_loc = torch.randint(0, 10_000, (int((end - start).sum()),), generator=generator)
        expected = req_to_token.clone()
        python_assign(expected, req_pool_indices, start, end, out_cache_loc)
        table = req_to_token.clone()
        assign_req_to_token_pool_torch(req_pool_indices, table, start, end, out_cache_loc)
        assert torch.equal(table, expected)
        on_device = [t.to(triton_device) for t in (req_pool_indices, req_to_token, start, end, out_cache_loc)]
        assign_req_to_token_pool_triton(*on_device)
        assert torch.equal(on_device[1].cpu(), expected)


def test_assign_draft_cache_locs():
    generator = torch.Generator().manual_seed(1)
    bs, topk, steps = 3, 4, 5
    req_to_token, req_pool_indices, seq_lens, _ = random_batch(generator, bs, 1)
    out_cache_loc = torch.randint(0, 10_000, (bs * topk * steps,), generator=generator)
    table = req_to_token.clone()
    assign_draft_cache_locs(req_pool_indices, table, seq_lens, out_cache_loc, topk * steps)
    for b in range(bs):
        row, s = int(req_pool_indices[b]), int(seq_lens[b])
        block = out_cache_loc.view(bs, topk * steps)[b]
        assert table[row, s : s + topk * steps].tolist() == block.tolist()
        assert torch.equal(table[row, :s], req_to_token[row, :s])


def test_create_flashinfer_kv_indices(triton_device: str):
    generator = torch.Generator().manual_seed(2)
    for bs in (1, 5):
        req_to_token, req_pool_indices, starts, ends = random_batch(generator, bs, 50)
        seq_lens = ends - starts
        expected_indices = torch.cat([req_to_token[r, s:e] for r, s, e in zip(
            req_pool_indices.tolist(), starts.tolist(), ends.tolist(), strict=True)])
        args = (req_to_token, req_pool_indices, seq_lens, starts)
        for impl, device in ((create_flashinfer_kv_indices_torch, "cpu"),
                             (create_flashinfer_kv_indices_triton, triton_device)):
            kv_indptr, kv_indices = (t.cpu() for t in impl(*(a.to(device) for a in args)))
            assert kv_indptr.dtype == torch.int32 and kv_indices.dtype == torch.int32
            assert kv_indptr.tolist() == [0, *torch.cumsum(seq_lens, 0).tolist()]
            assert torch.equal(kv_indices, expected_indices), impl.__name__
        # no start offsets, preallocated output buffer
        buffer = torch.full((200 * bs,), -7, dtype=torch.int32)
        kv_indptr, kv_indices = create_flashinfer_kv_indices(req_to_token, req_pool_indices, seq_lens,
                                                             kv_indices_out=buffer)
        total = int(kv_indptr[-1])
        assert kv_indices is buffer
        expected = torch.cat([req_to_token[r, :n] for r, n in zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                                                  strict=True)])
        assert torch.equal(buffer[:total], expected)
        triton_buffer = torch.full_like(buffer, -7).to(triton_device)
        create_flashinfer_kv_indices_triton(req_to_token.to(triton_device), req_pool_indices.to(triton_device),
                                            seq_lens.to(triton_device), kv_indices_out=triton_buffer)
        assert torch.equal(triton_buffer.cpu(), buffer)
