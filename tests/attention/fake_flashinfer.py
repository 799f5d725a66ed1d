"""A stand-in `flashinfer` module for CPU tests: the two paged-KV wrappers our backend uses, which
record every plan()/run() call and compute attention as FlashInfer's documentation defines it
(`BatchPrefillWithPagedKVCacheWrapper.plan`: `custom_mask` is the flattened boolean mask of shape
sum(q_len[i] * k_len[i]), each request's [q_len, k_len] matrix row-major; `causal` applies only
without a custom mask, aligned to the bottom right; kv_len = (pages - 1) * page_size +
last_page_len; sm_scale defaults to 1/sqrt(head_dim)).

It refuses `packed_custom_mask`: real FlashInfer then computes the per-request offsets in bits and
reads them as bytes, which is the bug our backend must not walk into.
"""

from __future__ import annotations

import types

import torch


class _Wrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kwargs) -> None:
        assert kv_layout == "NHD"
        self.init_kwargs = kwargs
        self.plan_calls: list[dict] = []
        self.run_calls: list[dict] = []

    def _kv_lens(self, kv_indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> list[int]:
        pages = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        return [(p - 1) * page_size + int(last) for p, last in zip(pages, last_page_len.tolist(), strict=True)]

    def _attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], qo_bounds: list[int],
                masks: list[torch.Tensor]) -> torch.Tensor:
        plan = self.plan_calls[-1]
        k_cache, v_cache = kv_cache
        page_size = plan["page_size"]
        assert k_cache.shape[1] == page_size  # NHD: [pages, page_size, Hkv, D]
        group = plan["num_qo_heads"] // plan["num_kv_heads"]
        scale = plan.get("sm_scale") or plan["head_dim"] ** -0.5
        indptr, indices = plan["kv_indptr"].tolist(), plan["kv_indices"]
        out = torch.empty_like(q)
        for b, mask in enumerate(masks):
            pages = indices[indptr[b] : indptr[b + 1]].long()
            k = k_cache[pages].flatten(0, 1)[: mask.shape[1]].float()  # [kv_len, Hkv, D]
            v = v_cache[pages].flatten(0, 1)[: mask.shape[1]].float()
            rows = q[qo_bounds[b] : qo_bounds[b + 1]].float()  # [q_len, H, D]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", rows, k) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            out[qo_bounds[b] : qo_bounds[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, sm_scale=None, q_data_type="float16", kv_data_type=None, **kwargs) -> None:
        if packed_custom_mask is not None:
            raise AssertionError("packed_custom_mask: FlashInfer would read bit offsets as byte offsets")
        if kwargs:
            raise AssertionError(f"unexpected plan arguments {sorted(kwargs)}")
        self.plan_calls.append(dict(
            qo_indptr=qo_indptr, kv_indptr=paged_kv_indptr, kv_indices=paged_kv_indices,
            kv_last_page_len=paged_kv_last_page_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim_qk, page_size=page_size, custom_mask=custom_mask, causal=causal,
            sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.run_calls.append(dict(q=q, paged_kv_cache=paged_kv_cache))
        plan = self.plan_calls[-1]
        qo = plan["qo_indptr"].tolist()
        kv_lens = self._kv_lens(plan["kv_indptr"], plan["kv_last_page_len"], plan["page_size"])
        masks, offset = [], 0
        for b, kv_len in enumerate(kv_lens):
            q_len = qo[b + 1] - qo[b]
            if plan["custom_mask"] is not None:
                masks.append(plan["custom_mask"][offset : offset + q_len * kv_len].view(q_len, kv_len))
                offset += q_len * kv_len
            elif plan["causal"]:
                masks.append(torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len))
            else:
                masks.append(torch.ones(q_len, kv_len, dtype=torch.bool))
        if plan["custom_mask"] is not None:
            assert offset == plan["custom_mask"].numel()
        return self._attend(q, paged_kv_cache, qo, masks)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             q_data_type="float16", kv_data_type=None, sm_scale=None, **kwargs) -> None:
        if kwargs:
            raise AssertionError(f"unexpected plan arguments {sorted(kwargs)}")
        self.plan_calls.append(dict(
            kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last_page_len, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, q_data_type=q_data_type,
            kv_data_type=kv_data_type, sm_scale=sm_scale))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.run_calls.append(dict(q=q, paged_kv_cache=paged_kv_cache))
        plan = self.plan_calls[-1]
        kv_lens = self._kv_lens(plan["kv_indptr"], plan["kv_last_page_len"], plan["page_size"])
        assert q.shape[0] == len(kv_lens)  # one query per request
        masks = [torch.ones(1, kv_len, dtype=torch.bool) for kv_len in kv_lens]
        return self._attend(q, paged_kv_cache, list(range(len(kv_lens) + 1)), masks)


def make_module() -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    return module
