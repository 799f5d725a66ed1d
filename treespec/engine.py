"""Engine: the in-process offline API. generate() queues requests and steps the Scheduler until
they finish (continuous batching: requests join and leave between steps)."""

from __future__ import annotations

import dataclasses

from treespec.args import ServerArgs
from treespec.request import new_rid
from treespec.request_checks import ModelLimits, check_request
from treespec.sampling_params import InvalidRequest, SamplingParams
from treespec.scheduler import Scheduler
from treespec.stop_strings import finish_text
from treespec.tokenizer import load_tokenizer


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs) -> None:
        names = {f.name for f in dataclasses.fields(ServerArgs)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown Engine argument(s): {sorted(unknown)}")
        self.server_args = ServerArgs(model_path=model_path, **kwargs).resolve()
        self.scheduler = Scheduler(self.server_args)
        self.tokenizer = load_tokenizer(self.server_args.tokenizer_path or self.scheduler.model_dir)
        self.scheduler.tokenizer = self.tokenizer
        self.limits = ModelLimits(self.scheduler.context_len, self.scheduler.allocator.size,
                                  self.scheduler.vocab_size)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> dict | list[dict]:
        """SGLang-style: returns {"text", "output_ids", "meta_info"} (a list for batched input)."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("pass exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            id_lists = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        else:
            if len(input_ids) == 0:
                raise InvalidRequest("the prompt is empty", param="input_ids")
            single = isinstance(input_ids[0], int)
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(id_lists):
                raise InvalidRequest("sampling_params list must match the number of prompts", param="sampling_params")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(id_lists)
        for ids, p in zip(id_lists, params, strict=True):
            check_request(ids, p, self.limits, top_logprobs_num, logprob_start_len)
        rids = []
        for ids, p in zip(id_lists, params, strict=True):
            rid = new_rid()
            self.scheduler.add_request(rid, ids, p, return_logprob, top_logprobs_num, logprob_start_len)
            rids.append(rid)
        results = self._run_until_done(rids)
        outs = [self._format(results[rid], p) for rid, p in zip(rids, params, strict=True)]
        return outs[0] if single else outs

    def _run_until_done(self, rids: list[str]) -> dict:
        pending = set(rids)
        acc: dict[str, dict] = {rid: {"output_ids": [], "logprobs": [], "top": [], "input_logprobs": None} for rid in rids}
        while pending:
            for out in self.scheduler.step():
                if out.rid not in acc:
                    continue
                entry = acc[out.rid]
                entry["output_ids"].extend(out.new_token_ids)
                if out.output_token_logprobs is not None:
                    entry["logprobs"].extend(out.output_token_logprobs)
                    entry["top"].extend(out.output_top_logprobs)
                if out.input_token_logprobs is not None:
                    entry["input_logprobs"] = out.input_token_logprobs
                if out.finished:
                    entry["meta_info"] = out.meta_info
                    pending.discard(out.rid)
        return acc

    def _format(self, entry: dict, params: SamplingParams) -> dict:
        meta = dict(entry["meta_info"])
        if entry["logprobs"]:
            meta["output_token_logprobs"] = entry["logprobs"]
            meta["output_top_logprobs"] = entry["top"]
        if entry["input_logprobs"] is not None:
            meta["input_token_logprobs"] = entry["input_logprobs"]
        return {
            "text": finish_text(self.tokenizer, entry["output_ids"], params, meta["finish_reason"]),
            "output_ids": entry["output_ids"],
            "meta_info": meta,
        }

    def get_stats(self) -> dict:
        return self.scheduler.get_stats()

    def check_pool_balance(self) -> None:
        self.scheduler.check_pool_balance()

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        self.scheduler = None
