"""IPC messages survive the wire format (nested dataclasses included), and nothing but our own messages
decodes."""

import orjson
import pytest

from treespec.request_output import RequestOutput
from treespec.sampling_params import SamplingParams
from treespec.server.io_struct import (
    AbortReq,
    BatchOutput,
    ControlReply,
    ControlReq,
    DetokenizeSettings,
    GenerateReq,
    IpcNames,
    MessageError,
    ReqError,
    decode,
    encode,
)


@pytest.mark.parametrize("msg", [
    GenerateReq([1, 2, 3], SamplingParams(max_new_tokens=4, stop=("\n",), stop_token_ids=(2,), seed=3), True, 2, 0),
    GenerateReq([1]),
    DetokenizeSettings("r1", ("\n", "END"), False, True),
    ReqError("r1", "the prompt is empty", 400, "prompt"),
    AbortReq("r1"),
    ControlReq("c1", "get_stats"),
    ControlReply("c1", "get_stats", True, {"num_running_reqs": 0, "token_usage": 0.5}),
    BatchOutput([RequestOutput("r1", [5, 6], True, {"type": "stop", "matched": "\n"}, {"id": "r1"},
                               output_token_logprobs=[[-0.5, 5], [-1.0, 6]], text_delta="hé", text="x hé")]),
])
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_generate_req_carries_a_frozen_sampling_params():
    back = decode(encode(GenerateReq([1], SamplingParams.from_dict({"stop": "x", "temperature": 0}))))
    assert isinstance(back.sampling_params, SamplingParams)
    assert back.sampling_params.stop == ("x",) and back.sampling_params.temperature == 0
    assert GenerateReq([1]).rid != GenerateReq([1]).rid


def test_unknown_or_malformed_messages_are_refused():
    with pytest.raises(MessageError):
        decode(orjson.dumps({"t": "os.system", "d": {}}))
    with pytest.raises(MessageError):
        decode(b"\x80\x04 not json")
    with pytest.raises(MessageError):
        encode(object())
    with pytest.raises(MessageError):  # a nested dataclass is checked as it is rebuilt
        decode(orjson.dumps({"t": "GenerateReq", "d": {"input_ids": [1], "sampling_params": {"top_p": 7}}}))
    with pytest.raises(MessageError):
        decode(orjson.dumps({"t": "BatchOutput", "d": {"items": [3]}}))


def test_ipc_names_live_in_the_given_dir(tmp_path):
    names = IpcNames.in_dir(str(tmp_path))
    addrs = [names.scheduler_input, names.detokenizer_input, names.tokenizer_input]
    assert len(set(addrs)) == 3
    assert all(a.startswith(f"ipc://{tmp_path}/") for a in addrs)
