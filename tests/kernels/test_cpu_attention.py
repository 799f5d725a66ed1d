import pytest
import torch

from treespec.attention.metadata import build_metadata
from treespec.attention.torch_backend import TorchAttnBackend
from treespec.kernels import cpu_attention
from treespec.kernels.mask_pack import pack_masks

kernel = cpu_attention.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU attention kernel does not build on this machine")
HAS_AVX512 = kernel is not None and bool(kernel.cpu_has_avx512())
# the kernel's codes this CPU runs: AVX2 always, AVX-512 where the CPU has it (same bits)
ISAS = [False, True] if HAS_AVX512 else [False]


def kernel_attention(q, k_buf, v_buf, qo_lens, kv_slots, masks, scale, avx512=HAS_AVX512):
    """Call the kernel on per-request inputs: masks None (all causal) or one bool mask per request."""
    qo = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()])
    kv = torch.tensor([0, *torch.tensor([s.numel() for s in kv_slots]).cumsum(0).tolist()])
    packed, indptr = cpu_attention.EMPTY_MASK, cpu_attention.EMPTY_INDPTR
    if masks is not None:
        packed, indptr = pack_masks(masks)
        indptr = indptr.to(torch.int64)
    return kernel.attention(q, k_buf, v_buf, qo, kv, torch.cat(kv_slots), packed, indptr, scale, avx512)


def random_pool(slots: int, kv_heads: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, kv_heads, head_dim, generator=g), torch.randn(slots, kv_heads, head_dim, generator=g), g


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 20), (8, 2, 128), (6, 1, 40), (4, 2, 48)])
def test_matches_reference_causal_and_masked(heads: int, kv_heads: int, head_dim: int, avx512: bool):
    k_buf, v_buf, g = random_pool(300, kv_heads, head_dim, head_dim)
    qo_lens, kv_lens = [1, 3, 1, 5, 20], [37, 12, 1, 90, 41]
    kv_slots = [torch.randperm(299, generator=g)[:n] + 1 for n in kv_lens]
    q = torch.randn(sum(qo_lens), heads, head_dim, generator=g)
    scale = head_dim**-0.5
    causal = cpu_attention.reference_attention(q, k_buf, v_buf, qo_lens, kv_slots, [None] * 5, scale)
    torch.testing.assert_close(kernel_attention(q, k_buf, v_buf, qo_lens, kv_slots, None, scale, avx512), causal)
    masks = [torch.rand(qn, kn, generator=g) < 0.6 for qn, kn in zip(qo_lens, kv_lens, strict=True)]
    for m in masks:
        m[:, 0] = True  # every row sees something (the empty case has its own test)
    masked = cpu_attention.reference_attention(q, k_buf, v_buf, qo_lens, kv_slots, masks, scale)
    torch.testing.assert_close(kernel_attention(q, k_buf, v_buf, qo_lens, kv_slots, masks, scale, avx512), masked)


@pytest.mark.parametrize("avx512", ISAS)
def test_masks_with_long_visible_prefixes(avx512: bool):
    """Tree masks: each row sees a long run of leading columns (the kernel skips whole mask bytes of it
    to find the columns every row sees), then holes; runs ending at every bit of a byte, and at none."""
    heads, kv_heads, head_dim = 9, 3, 64
    k_buf, v_buf, g = random_pool(300, kv_heads, head_dim, 7)
    qo_lens, kv_lens = [6, 5, 8], [97, 64, 131]
    kv_slots = [torch.randperm(299, generator=g)[:n] + 1 for n in kv_lens]
    q = torch.randn(sum(qo_lens), heads, head_dim, generator=g)
    masks = []
    for qn, kn in zip(qo_lens, kv_lens, strict=True):
        m = torch.rand(qn, kn, generator=g) < 0.5
        for i in range(qn):
            run = kn if i == qn - 1 else kn - 40 + 3 * i + int(torch.randint(0, 8, (1,), generator=g))
            m[i, :run] = True
            if run < kn:
                m[i, run] = False  # the run ends exactly here
        masks.append(m)
    want = cpu_attention.reference_attention(q, k_buf, v_buf, qo_lens, kv_slots, masks, head_dim**-0.5)
    got = kernel_attention(q, k_buf, v_buf, qo_lens, kv_slots, masks, head_dim**-0.5, avx512)
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512")
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 48), (2, 1, 16)])
def test_avx512_code_gives_the_avx2_codes_bits(heads: int, kv_heads: int, head_dim: int):
    """The AVX-512 unit code (16 dots reduced by one shuffle tree) computes every element as the AVX2
    unit code (8 dots a tree, each tree the per-(row, head) code's horizontal sum) does: causal and masked, trees sharing a prefix, rows with
    their own columns, blocks of 16 columns full and partial, one row and 64 rows."""
    k_buf, v_buf, g = random_pool(700, kv_heads, head_dim, 7 + head_dim)
    qo_lens, kv_lens = [1, 9, 3, 17, 64, 1, 2], [1, 250, 40, 33, 300, 17, 16]
    kv_slots = [torch.randperm(699, generator=g)[:n] + 1 for n in kv_lens]
    q = torch.randn(sum(qo_lens), heads, head_dim, generator=g)
    scale = head_dim**-0.5
    for masks in (None, "prefix-and-random"):
        if masks is not None:
            masks = [torch.rand(qn, kn, generator=g) < 0.5 for qn, kn in zip(qo_lens, kv_lens, strict=True)]
            for m, kn in zip(masks, kv_lens, strict=True):
                m[:, : kn * 2 // 3] = True  # a prefix all rows see, then each row's own columns
            masks[2][1] = False  # a row that sees nothing
        avx2 = kernel_attention(q, k_buf, v_buf, qo_lens, kv_slots, masks, scale, avx512=False)
        avx512 = kernel_attention(q, k_buf, v_buf, qo_lens, kv_slots, masks, scale, avx512=True)
        assert torch.equal(avx2, avx512)


@pytest.mark.parametrize("avx512", ISAS)
def test_tree_verify_row_is_bit_identical_to_decode(avx512: bool):
    """Every verify row (prefix + a 4-node tree, mask) equals the causal decode of its path (masked
    columns between the visible ones change nothing), and a decode row's output does not depend on
    the other requests in the batch."""
    k_buf, v_buf, g = random_pool(600, 3, 64, 1)
    prefix = torch.arange(1, 451)
    tree_slots = torch.tensor([500, 501, 502, 503])
    q = torch.randn(4, 9, 64, generator=g)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 450, dtype=torch.bool), tree], dim=1)
    verify = kernel_attention(q, k_buf, v_buf, [4], [torch.cat([prefix, tree_slots])], [mask], 0.125, avx512)
    decode = kernel_attention(q[:1], k_buf, v_buf, [1], [torch.cat([prefix, tree_slots[:1]])], None, 0.125, avx512)
    assert torch.equal(verify[0], decode[0])
    # node 3 (path root -> 1 -> 3) equals a causal extend of the same path
    path = torch.cat([prefix, tree_slots[[0, 1, 3]]])
    extend = kernel_attention(q[[0, 1, 3]], k_buf, v_buf, [3], [path], None, 0.125, avx512)
    assert torch.equal(verify[3], extend[2])
    other = torch.randn(2, 9, 64, generator=g)
    batched = kernel_attention(torch.cat([other, q[:1]]), k_buf, v_buf, [2, 1],
                               [torch.arange(100, 180), torch.cat([prefix, tree_slots[:1]])], None, 0.125, avx512)
    assert torch.equal(batched[2], decode[0])


@pytest.mark.parametrize("avx512", ISAS)
@pytest.mark.parametrize("chain", [1, 2, 5, 8, 12])
def test_chain_verify_without_a_mask_gives_the_masked_bits(avx512: bool, chain: int):
    """A chain's tree mask (node t sees the prefix and nodes 0..t) is bottom-right causal attention over
    prefix + chain, so verify_batch sends chains without a mask: every row the same bits either way."""
    k_buf, v_buf, g = random_pool(600, 3, 64, 5)
    slots = torch.cat([torch.arange(1, 331), torch.arange(400, 400 + chain)])
    q = torch.randn(chain, 9, 64, generator=g)
    mask = torch.cat([torch.ones(chain, 330, dtype=torch.bool), torch.ones(chain, chain).tril().bool()], dim=1)
    masked = kernel_attention(q, k_buf, v_buf, [chain], [slots], [mask], 0.125, avx512)
    causal = kernel_attention(q, k_buf, v_buf, [chain], [slots], None, 0.125, avx512)
    assert torch.equal(masked, causal)


@pytest.mark.parametrize("avx512", ISAS)
def test_row_without_visible_columns_is_zero(avx512: bool):
    k_buf, v_buf, g = random_pool(20, 2, 16, 2)
    q = torch.randn(2, 2, 16, generator=g)
    mask = torch.tensor([[False, False, False], [True, False, True]])
    out = kernel_attention(q, k_buf, v_buf, [2], [torch.tensor([3, 4, 5])], [mask], 0.25, avx512)
    assert torch.equal(out[0], torch.zeros(2, 16))
    assert torch.isfinite(out).all()


def test_backend_uses_the_kernel_for_every_fp32_batch_and_agrees_with_sdpa():
    """Decode, verify, draft-tree and prefill metadata all go to the kernel (fp32 CPU); without it SDPA
    serves; both paths give the same attention."""
    k_buf, v_buf, g = random_pool(400, 3, 64, 3)
    with_kernel = TorchAttnBackend(torch.device("cpu"), torch.float32)
    sdpa = TorchAttnBackend(torch.device("cpu"))
    assert sdpa.kernel is None and with_kernel.kernel is not None
    prefix_a, prefix_b = torch.arange(1, 120), torch.arange(200, 260)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    cases = [
        (build_metadata([1, 1], [prefix_a, prefix_b]), True),  # decode
        (build_metadata([3, 3], [torch.cat([prefix_a, torch.tensor([300, 301, 302])]),
                                 torch.cat([prefix_b, torch.tensor([303, 304, 305])])],
                        [torch.cat([torch.ones(3, 119, dtype=torch.bool), tree], 1),
                         torch.cat([torch.ones(3, 60, dtype=torch.bool), tree], 1)]), True),  # verify
        (build_metadata([64], [prefix_a]), True),  # a large tree
        (build_metadata([119, 60], [prefix_a, prefix_b]), True),  # prefill chunks
    ]
    for meta, expect_kernel in cases:
        q = torch.randn(int(meta.qo_indptr[-1]), 9, 64, generator=g)
        with_kernel.init_forward_metadata(meta)
        sdpa.init_forward_metadata(meta)
        assert (with_kernel.kernel_args is not None) == expect_kernel
        torch.testing.assert_close(with_kernel.forward(q, k_buf, v_buf, 0.125), sdpa.forward(q, k_buf, v_buf, 0.125))


def test_verify_forward_reproduces_decode_bit_for_bit(tmp_path):
    """A whole TARGET_VERIFY forward (tiny Llama, fp32, the CPU kernels) gives every tree node the
    logits that decoding its path token by token gives: greedy speculation is exact by construction."""
    from model_factory import make_tiny_model

    from treespec.forward_batch import ForwardBatch, ForwardMode
    from treespec.kernels import cpu_linear, cpu_norm
    from treespec.model_runner import ModelRunner

    if cpu_linear.load() is None or cpu_norm.load() is None:
        pytest.skip("the panel and norm kernels are needed for a batch-invariant forward")
    runner = ModelRunner(make_tiny_model("llama", tmp_path / "llama"), torch.float32, torch.device("cpu"),
                         kv_pool_size=64)
    prompt = torch.tensor([3, 17, 5, 9, 11, 2, 7])
    prefix = torch.arange(1, 8)

    def forward(mode, ids, positions, slots, kv, masks=None):
        attn = build_metadata([len(ids)], [kv], masks)
        return runner.forward(ForwardBatch(mode=mode, input_ids=torch.tensor(ids), positions=torch.tensor(positions),
                                           out_cache_loc=torch.tensor(slots), attn=attn)).logits

    forward(ForwardMode.EXTEND, prompt.tolist(), list(range(7)), prefix.tolist(), prefix)
    # root 40 -> (n1 41 -> n3 43), (n2 42): nodes in slots 8..11, depths 0, 1, 1, 2
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 7, dtype=torch.bool), tree], dim=1)
    verify = forward(ForwardMode.TARGET_VERIFY, [40, 41, 42, 43], [7, 8, 8, 9], [8, 9, 10, 11],
                     torch.cat([prefix, torch.tensor([8, 9, 10, 11])]), [mask])
    decode = {}
    for node, token, pos, slot, path_slots in [(0, 40, 7, 20, [20]), (1, 41, 8, 21, [20, 21]),
                                               (3, 43, 9, 22, [20, 21, 22]), (2, 42, 8, 23, [20, 23])]:
        decode[node] = forward(ForwardMode.DECODE, [token], [pos], [slot],
                               torch.cat([prefix, torch.tensor(path_slots)]))[0]
    for node in range(4):
        assert torch.equal(verify[node], decode[node]), node


@pytest.mark.parametrize("avx512", ISAS)
def test_largest_default_tree_verifies_on_the_kernel_bit_for_bit(tmp_path, avx512: bool):
    """A 27-node tree (the most the default hybrid builds: 3 head nodes + 24 n-gram nodes), two chains of
    13 under the root, verifies on the kernel with either code, and each node's logits equal decoding its
    path token by token (above 8 rows this used to go to SDPA, which is not batch-invariant: with SDPA
    this test fails)."""
    from model_factory import make_tiny_model

    from treespec.forward_batch import ForwardBatch, ForwardMode
    from treespec.kernels import cpu_linear, cpu_norm
    from treespec.model_runner import ModelRunner

    if cpu_linear.load() is None or cpu_norm.load() is None:
        pytest.skip("the panel and norm kernels are needed for a batch-invariant forward")
    runner = ModelRunner(make_tiny_model("llama", tmp_path / "llama"), torch.float32, torch.device("cpu"),
                         kv_pool_size=128)
    backend = runner.attn_backend
    backend.avx512 = avx512
    prefix = torch.arange(1, 8)

    def forward(mode, ids, positions, slots, kv, masks=None):
        attn = build_metadata([len(ids)], [kv], masks)
        return runner.forward(ForwardBatch(mode=mode, input_ids=torch.tensor(ids), positions=torch.tensor(positions),
                                           out_cache_loc=torch.tensor(slots), attn=attn)).logits

    forward(ForwardMode.EXTEND, [3, 17, 5, 9, 11, 2, 7], list(range(7)), prefix.tolist(), prefix)
    chain = 13
    parents = [-1] + [0 if i in (1, chain + 1) else i - 1 for i in range(1, 2 * chain + 1)]
    tokens = [40 + i for i in range(2 * chain + 1)]
    depth = [0] * len(parents)
    tree = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        tree[i, i] = True
        if p >= 0:
            tree[i] |= tree[p]
            depth[i] = depth[p] + 1
    slots = list(range(8, 8 + len(parents)))
    mask = torch.cat([torch.ones(len(parents), 7, dtype=torch.bool), tree], dim=1)
    verify = forward(ForwardMode.TARGET_VERIFY, tokens, [7 + d for d in depth], slots,
                     torch.cat([prefix, torch.tensor(slots)]), [mask])
    assert backend.kernel_args is not None  # the kernel's path, not SDPA's
    next_slot = 60
    for branch in (range(0, chain + 1), [0, *range(chain + 1, 2 * chain + 1)]):
        path_slots = []
        for node in branch:
            path_slots.append(next_slot)
            decode = forward(ForwardMode.DECODE, [tokens[node]], [7 + depth[node]], [next_slot],
                             torch.cat([prefix, torch.tensor(path_slots)]))[0]
            next_slot += 1
            assert torch.equal(verify[node], decode), node


def test_rope_store_matches_apply_rope_and_set_kv():
    from treespec.models.layers import RotaryEmbedding, apply_rope

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, tokens = 4, 2, 16, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    cos, sin = RotaryEmbedding(head_dim, 64, 10000.0, None)(torch.tensor([5, 9, 40]), torch.float32)
    loc = torch.tensor([7, 2, 11])
    k_buf, v_buf = torch.zeros(12, kv_heads, head_dim), torch.zeros(12, kv_heads, head_dim)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos, sin)
    want_v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim).clone()
    kernel.rope_store(qkv, cos, sin, loc, k_buf, v_buf, heads)
    torch.testing.assert_close(qkv[:, : heads * head_dim].view(tokens, heads, head_dim), qk[:, :heads])
    torch.testing.assert_close(k_buf[loc], qk[:, heads:])
    assert torch.equal(v_buf[loc], want_v)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[loc] = False
    assert not k_buf[untouched].any() and not v_buf[untouched].any()
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel.rope_store(qkv, cos, sin, torch.tensor([7, 2, 12]), k_buf, v_buf, heads)


@pytest.mark.parametrize("avx512", ISAS)
def test_prefill_rows_do_not_depend_on_the_batch_or_the_cache(tmp_path, avx512: bool):
    """A prompt's last-row logits are the same bits prefilled alone (90 rows), beside a 100-row prompt
    in one batch, and in two chunks (a prefix-cache hit of 30 tokens, then 60 rows): the prefill, like
    decode and verify, runs the kernel row by row (a long request used to send the whole batch to SDPA,
    which gives other bits; this test failed then)."""
    from model_factory import make_tiny_model

    from treespec.forward_batch import ForwardBatch, ForwardMode
    from treespec.kernels import cpu_linear, cpu_norm
    from treespec.model_runner import ModelRunner

    if cpu_linear.load() is None or cpu_norm.load() is None:
        pytest.skip("the panel and norm kernels are needed for a batch-invariant forward")
    runner = ModelRunner(make_tiny_model("llama", tmp_path / "llama"), torch.float32, torch.device("cpu"),
                         kv_pool_size=512)
    runner.attn_backend.avx512 = avx512
    g = torch.Generator().manual_seed(7)
    prompt_a, prompt_b = torch.randint(3, 250, (90,), generator=g), torch.randint(3, 250, (100,), generator=g)

    def prefill(chunks):  # chunks: (ids, first position, first slot) per request, one batch
        slots = [torch.arange(slot - pos, slot + len(ids)) for ids, pos, slot in chunks]
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.cat([ids for ids, _, _ in chunks]),
                             positions=torch.cat([torch.arange(pos, pos + len(ids)) for ids, pos, _ in chunks]),
                             out_cache_loc=torch.cat([s[-len(ids):] for s, (ids, _, _) in zip(slots, chunks, strict=True)]),
                             attn=build_metadata([len(ids) for ids, _, _ in chunks], slots))
        batch.logits_indices = torch.cumsum(torch.tensor([len(ids) for ids, _, _ in chunks]), 0) - 1
        return runner.forward(batch).logits

    alone = prefill([(prompt_a, 0, 1)])[0]
    assert torch.equal(prefill([(prompt_b, 0, 200), (prompt_a, 0, 1)])[1], alone)
    prefill([(prompt_a[:30], 0, 1)])
    assert torch.equal(prefill([(prompt_a[30:], 30, 31)])[0], alone)


@pytest.mark.parametrize("avx512", ISAS)
def test_prefill_rows_equal_their_decodes(avx512: bool):
    """Every row of a causal prefill (with and without cached columns before it) is the same bits as
    decoding that row alone over the columns it sees: the prefill's units share the columns their first
    row sees and add each row's rest, a decode shares them all."""
    heads, kv_heads, head_dim = 9, 3, 64
    k_buf, v_buf, g = random_pool(200, kv_heads, head_dim, 11)
    slots = torch.randperm(199, generator=g)[:75] + 1
    for cached in (0, 20):
        rows = slots.numel() - cached
        q = torch.randn(rows, heads, head_dim, generator=g)
        prefill = kernel_attention(q, k_buf, v_buf, [rows], [slots], None, head_dim**-0.5, avx512)
        for i in range(rows):
            decode = kernel_attention(q[i:i + 1], k_buf, v_buf, [1], [slots[:cached + i + 1]], None, head_dim**-0.5, avx512)
            assert torch.equal(prefill[i], decode[0]), (cached, i)
