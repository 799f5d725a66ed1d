"""The TokenizerManager over real ipc sockets, with the test playing scheduler and detokenizer: chunks
carry deltas and the finishing chunk the whole result; a ReqError becomes an ApiError; a consumer that
stops early aborts its request."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from treespec.request_checks import ModelLimits
from treespec.request_output import RequestOutput
from treespec.sampling_params import SamplingParams
from treespec.server.io_struct import AbortReq, BatchOutput, GenerateReq, IpcNames, ReqError, decode, encode
from treespec.server.proc_util import make_socket
from treespec.server.protocol import ApiError
from treespec.server.tokenizer_manager import TokenizerManager

LIMITS = ModelLimits(context_len=100, max_total_num_tokens=100, vocab_size=1000)


async def recv(sock: zmq.Socket, timeout_s: float = 10.0):
    for _ in range(int(timeout_s * 100)):
        try:
            return decode(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            await asyncio.sleep(0.01)
    raise AssertionError("no message")


def run(tmp_path, body) -> None:
    async def main() -> None:
        names = IpcNames.in_dir(str(tmp_path))
        ctx = zmq.Context()
        sched = make_socket(ctx, zmq.PULL, bind=names.scheduler_input)
        tm = TokenizerManager(names, tokenizer=None, limits=LIMITS)
        await tm.start()
        to_tm = make_socket(ctx, zmq.PUSH, connect=names.tokenizer_input)
        try:
            await body(tm, sched, to_tm)
        finally:
            await tm.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_chunks_carry_deltas_and_the_last_one_the_whole_result(tmp_path):
    async def body(tm, sched, to_tm):
        req = GenerateReq([1, 2], SamplingParams(max_new_tokens=3), return_logprob=True)
        gen = tm.generate(req)
        first_task = asyncio.ensure_future(gen.__anext__())
        assert (await recv(sched)) == req
        outs = [RequestOutput(req.rid, [5], False, None, {"id": req.rid}, [(-0.1, 5)], [[]], [(None, 1), (-2.0, 2)],
                              text_delta="Hel"),
                RequestOutput(req.rid, [6, 7], True, {"type": "length", "length": 3}, {"id": req.rid},
                              [(-0.2, 6), (-0.3, 7)], [[], []], text_delta="lo!", text="Hello!")]
        to_tm.send(encode(BatchOutput(outs)))
        first = await first_task
        rest = [c async for c in gen]
        assert (first.delta, first.new_ids, first.finished, first.text, first.output_ids) == ("Hel", [5], False, None, None)
        (last,) = rest
        assert (last.delta, last.new_ids, last.text, last.output_ids) == ("lo!", [6, 7], "Hello!", [5, 6, 7])
        # SGLang's form: (logprob, token id, text) with the text None unless return_text_in_logprobs
        assert last.meta_info["output_token_logprobs"] == [(-0.1, 5, None), (-0.2, 6, None), (-0.3, 7, None)]
        assert last.meta_info["input_token_logprobs"] == [(None, 1, None), (-2.0, 2, None)]
        assert "output_top_logprobs" not in last.meta_info  # only with top_logprobs_num > 0
        assert first.meta_info["output_token_logprobs"] == [(-0.1, 5, None)]  # the logprobs so far
        assert [tuple(p) for p in last.logprobs] == [(-0.1, 5), (-0.2, 6), (-0.3, 7)]  # pairs, for the OpenAI routes
        assert tm.num_pending() == 0 and tm.num_client_aborts == 0
        latency = tm.latency
        assert latency.time_to_first_token.count == 1 and latency.e2e_request_latency.count == 1
        assert latency.inter_token_latency.count == 2  # one output brought two tokens: two intervals

    run(tmp_path, body)


def test_req_error_is_raised_as_api_error_without_an_abort(tmp_path):
    async def body(tm, sched, to_tm):
        req = GenerateReq([1])
        task = asyncio.ensure_future(tm.generate_full(req))
        assert (await recv(sched)) == req
        to_tm.send(encode(ReqError(req.rid, "no room for this request", 400, "max_tokens")))
        with pytest.raises(ApiError) as e:
            await task
        assert (e.value.status, e.value.param, e.value.message) == (400, "max_tokens", "no room for this request")
        assert tm.num_client_aborts == 0 and not sched.poll(200)

    run(tmp_path, body)


def test_consumer_that_stops_early_aborts_the_request(tmp_path):
    async def body(tm, sched, to_tm):
        req = GenerateReq([1], SamplingParams(max_new_tokens=50))
        gen = tm.generate(req)
        task = asyncio.ensure_future(gen.__anext__())
        await recv(sched)
        to_tm.send(encode(BatchOutput([RequestOutput(req.rid, [5], False, None, {}, text_delta="a")])))
        assert (await task).delta == "a"
        await gen.aclose()
        assert (await recv(sched)) == AbortReq(req.rid)
        assert tm.num_client_aborts == 1 and tm.num_pending() == 0

    run(tmp_path, body)


def test_check_rejects_before_sending(tmp_path):
    async def body(tm, sched, to_tm):
        with pytest.raises(ApiError) as e:
            tm.validate(GenerateReq([1] * 99, SamplingParams(max_new_tokens=5)))
        assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
        assert not sched.poll(100)

    run(tmp_path, body)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(96 + i) for i in ids)


def test_return_text_in_logprobs_decodes_each_token(tmp_path):
    async def body(tm, sched, to_tm):
        tm.tokenizer = CharTokenizer()
        req = GenerateReq([1, 2], SamplingParams(max_new_tokens=1), True, top_logprobs_num=2, logprob_start_len=0,
                          return_text_in_logprobs=True)
        task = asyncio.ensure_future(tm.generate_full(req))
        await recv(sched)
        to_tm.send(encode(BatchOutput([RequestOutput(
            req.rid, [3], True, {"type": "length", "length": 1}, {"id": req.rid}, [(-0.5, 3)], [[(-0.5, 3), (-1.5, 4)]],
            [(None, 1), (-2.0, 2)], [None, [(-0.1, 2), (-3.0, 5)]], text="c")])))
        meta = (await task).meta_info
        assert meta["output_token_logprobs"] == [(-0.5, 3, "c")]
        assert meta["output_top_logprobs"] == [[(-0.5, 3, "c"), (-1.5, 4, "d")]]
        assert meta["input_token_logprobs"] == [(None, 1, "a"), (-2.0, 2, "b")]
        assert meta["input_top_logprobs"] == [None, [(-0.1, 2, "b"), (-3.0, 5, "e")]]

    run(tmp_path, body)


def test_client_rid_duplicate_and_abort_by_rid(tmp_path):
    async def body(tm, sched, to_tm):
        req = GenerateReq([1], SamplingParams(max_new_tokens=50), rid="mine")
        task = asyncio.ensure_future(tm.generate_full(req))
        assert (await recv(sched)).rid == "mine"
        with pytest.raises(ApiError) as e:
            tm.validate(GenerateReq([1], SamplingParams(max_new_tokens=5), rid="mine"))
        assert e.value.param == "rid" and e.value.status == 400
        assert tm.abort("other") == [] and not sched.poll(100)  # an unknown rid: nothing to do
        assert tm.abort("mine") == ["mine"]
        assert (await recv(sched)) == AbortReq("mine")
        abort = {"type": "abort", "message": "aborted"}
        to_tm.send(encode(BatchOutput([RequestOutput("mine", [], True, abort, {"id": "mine", "finish_reason": abort},
                                                     text="")])))
        last = await task
        assert last.meta_info["finish_reason"]["type"] == "abort" and last.meta_info["id"] == "mine"
        assert tm.num_pending() == 0 and tm.num_client_aborts == 0
        tm.validate(GenerateReq([1], SamplingParams(max_new_tokens=5), rid="mine"))  # finished: the rid is free again

    run(tmp_path, body)
