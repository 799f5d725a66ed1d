"""The detokenizer process: incremental, UTF-8-safe detokenization and stop-string trimming.

Per request it keeps the token ids and two offsets (as in HF's streaming decoders): `prefix_offset`
starts a few tokens back so that decoding in context gives the right leading space, `read_offset` is
where the already-emitted text ends. Text that ends in U+FFFD (half a multi-byte character) is held
back until the next token completes it, and so is any tail that could be the start of a stop string,
so a streamed delta never contains a piece of a stop string that the final text trims away.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import zmq

from treespec.engine import finish_text, load_tokenizer
from treespec.sampling_params import SamplingParams
from treespec.server.io_struct import (
    BatchTextOut,
    BatchTokenOut,
    IpcNames,
    MessageError,
    TextOut,
    decode,
    encode,
)
from treespec.server.proc_util import ParentWatch, make_socket, setup_child

logger = logging.getLogger("treespec.detokenizer")

IDLE_POLL_MS = 500
MAX_TRACKED = 65536


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # decoded text of ids[:read_offset]
    sent_len: int = 0  # characters of `text` already emitted


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `stops`."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    """Turns per-request token deltas into text deltas. Pure logic: the process loop feeds it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def step(self, rid: str, new_ids: list[int], skip_special_tokens: bool) -> None:
        st = self.states.get(rid)
        if st is None:
            if len(self.states) >= MAX_TRACKED:  # a leak guard; finished requests are dropped below
                self.states.pop(next(iter(self.states)))
            st = self.states[rid] = DecodeState()
        st.ids.extend(new_ids)
        if not new_ids:
            return
        decode = self.tokenizer.decode
        prefix_text = decode(st.ids[st.prefix_offset : st.read_offset], skip_special_tokens=skip_special_tokens)
        new_text = decode(st.ids[st.prefix_offset :], skip_special_tokens=skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            st.text += new_text[len(prefix_text) :]
            st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)

    def delta(self, rid: str, stops: list[str], no_stop_trim: bool) -> str:
        """The text that can be emitted now (never a possible stop-string start, never half a char)."""
        st = self.states[rid]
        end = len(st.text)
        if stops and not no_stop_trim:
            end -= stop_holdback(st.text, stops)
            for s in stops:
                cut = st.text.find(s)
                if cut >= 0:
                    end = min(end, cut)
        if end <= st.sent_len:
            return ""
        out = st.text[st.sent_len : end]
        st.sent_len = end
        return out

    def finish(self, rid: str, params: SamplingParams, finish_reason: dict | None) -> tuple[str, str]:
        """Final (delta, full text); the full text is exactly what the in-process Engine returns."""
        st = self.states.pop(rid, None) or DecodeState()
        full = finish_text(self.tokenizer, st.ids, params, finish_reason)
        sent = st.text[: st.sent_len]
        delta = full[len(sent) :] if full.startswith(sent) else ""
        return delta, full


def run_detokenizer_process(log_level: str, tokenizer_path: str, names: IpcNames, ready: Connection) -> None:
    setup_child("detokenizer", log_level)
    ctx = zmq.Context()
    try:
        detok = IncrementalDetokenizer(load_tokenizer(tokenizer_path))
        recv_sock = make_socket(ctx, zmq.PULL, bind=names.detokenizer_input)
        send_sock = make_socket(ctx, zmq.PUSH, connect=names.tokenizer_input)
    except Exception as e:
        ready.send({"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return
    ready.send({"status": "ready"})
    ready.close()
    watch = ParentWatch()
    try:
        while watch.parent_alive():
            if not recv_sock.poll(IDLE_POLL_MS):
                continue
            try:
                msg = decode(recv_sock.recv())
            except MessageError as e:
                logger.error("dropping a malformed message: %s", e)
                continue
            if isinstance(msg, BatchTokenOut):
                send_sock.send(encode(process_batch(detok, msg)))
    except SystemExit:
        pass
    except BaseException:
        logger.critical("detokenizer crashed:\n%s", traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        ctx.destroy(linger=0)


def process_batch(detok: IncrementalDetokenizer, batch: BatchTokenOut) -> BatchTextOut:
    items = []
    for t in batch.items:
        detok.step(t.rid, t.new_token_ids, t.skip_special_tokens)
        full = None
        if t.finished:
            params = SamplingParams(stop=t.stop, skip_special_tokens=t.skip_special_tokens,
                                    no_stop_trim=t.no_stop_trim)
            delta, full = detok.finish(t.rid, params, t.finish_reason)
        else:
            delta = detok.delta(t.rid, t.stop, t.no_stop_trim)
        items.append(TextOut(
            rid=t.rid, delta=delta, new_token_ids=t.new_token_ids, finished=t.finished,
            meta_info=t.meta_info, text=full, output_token_logprobs=t.output_token_logprobs,
            output_top_logprobs=t.output_top_logprobs, input_token_logprobs=t.input_token_logprobs,
        ))
    return BatchTextOut(items)
