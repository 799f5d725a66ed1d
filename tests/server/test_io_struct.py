"""IPC messages survive the wire format, and nothing but our own messages decodes."""

import orjson
import pytest

from treespec.server.io_struct import (
    AbortReq,
    BatchTextOut,
    BatchTokenOut,
    ControlReply,
    ControlReq,
    IpcNames,
    MessageError,
    TextOut,
    TokenizedGenerateReq,
    TokenOut,
    decode,
    encode,
)


@pytest.mark.parametrize("msg", [
    TokenizedGenerateReq("r1", [1, 2, 3], {"max_new_tokens": 4, "stop": ["\n"]}, True, 2, 0),
    AbortReq("r1"),
    ControlReq("c1", "get_stats"),
    ControlReply("c1", "get_stats", True, {"num_running_reqs": 0, "token_usage": 0.5}),
    BatchTokenOut([TokenOut("r1", [5, 6], True, {"type": "stop", "matched": "\n"}, {"id": "r1"},
                            stop=["\n"], output_token_logprobs=[[-0.5, 5], [-1.0, 6]])]),
    BatchTextOut([TextOut("r1", "hé", [5], False, {"id": "r1"}), TextOut("r2", "", [], True, {}, text="x")]),
])
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_unknown_or_malformed_messages_are_refused():
    with pytest.raises(MessageError):
        decode(orjson.dumps({"t": "os.system", "d": {}}))
    with pytest.raises(MessageError):
        decode(b"\x80\x04 not json")
    with pytest.raises(MessageError):
        encode(object())


def test_ipc_names_live_in_the_given_dir(tmp_path):
    names = IpcNames.in_dir(str(tmp_path))
    addrs = [names.scheduler_input, names.detokenizer_input, names.tokenizer_input]
    assert len(set(addrs)) == 3
    assert all(a.startswith(f"ipc://{tmp_path}/") for a in addrs)
