"""The detokenizer process: incremental, UTF-8-safe detokenization and stop-string trimming.

Per request it keeps the settings the scheduler sent once (DetokenizeSettings), the token ids and two
offsets (as in HF's streaming decoders): `prefix_offset` starts a few tokens back so that decoding in
context gives the right leading space, `read_offset` is where the already-emitted text ends. Text that
ends in U+FFFD (half a multi-byte character) is held back until the next token completes it, and so is
any tail that could be the start of a stop string, so a streamed delta never contains a piece of a stop
string that the final text trims away.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import zmq

from treespec.request_output import RequestOutput
from treespec.server.io_struct import (
    BatchOutput,
    DetokenizeSettings,
    IpcNames,
    MessageError,
    ReqError,
    decode,
    encode,
)
from treespec.server.proc_util import ParentWatch, make_socket, setup_child
from treespec.stop_strings import streamable_end, trim_stop
from treespec.tokenizer import load_tokenizer

logger = logging.getLogger("treespec.detokenizer")

IDLE_POLL_MS = 500
MAX_TRACKED = 65536


@dataclass
class DecodeState:
    settings: DetokenizeSettings
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # decoded text of ids[:read_offset]
    sent_len: int = 0  # characters of `text` already emitted


class IncrementalDetokenizer:
    """Turns per-request token deltas into text deltas. Pure logic: the process loop feeds it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def forget(self, rid: str) -> None:
        """A request that ends without a finished output (refused after it was queued)."""
        self.states.pop(rid, None)

    def start(self, settings: DetokenizeSettings) -> None:
        if len(self.states) >= MAX_TRACKED:  # a leak guard; finished requests are dropped in finish()
            self.states.pop(next(iter(self.states)))
        self.states[settings.rid] = DecodeState(settings)

    def _state(self, rid: str) -> DecodeState:
        st = self.states.get(rid)
        if st is None:  # no settings seen (evicted by the leak guard): the defaults
            st = self.states[rid] = DecodeState(DetokenizeSettings(rid))
        return st

    def step(self, rid: str, new_ids: list[int]) -> None:
        st = self._state(rid)
        st.ids.extend(new_ids)
        if not new_ids:
            return
        skip = st.settings.skip_special_tokens
        prefix_text = self.tokenizer.decode(st.ids[st.prefix_offset : st.read_offset], skip_special_tokens=skip)
        new_text = self.tokenizer.decode(st.ids[st.prefix_offset :], skip_special_tokens=skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            st.text += new_text[len(prefix_text) :]
            st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)

    def delta(self, rid: str) -> str:
        """The text that can be emitted now (never a possible stop-string start, never half a char)."""
        st = self._state(rid)
        end = len(st.text) if st.settings.no_stop_trim else streamable_end(st.text, st.settings.stop)
        if end <= st.sent_len:
            return ""
        out = st.text[st.sent_len : end]
        st.sent_len = end
        return out

    def finish(self, rid: str, finish_reason: dict | None) -> tuple[str, str]:
        """Final (delta, full text); the full text is exactly what the in-process Engine returns."""
        st = self.states.pop(rid, None) or DecodeState(DetokenizeSettings(rid))
        text = self.tokenizer.decode(st.ids, skip_special_tokens=st.settings.skip_special_tokens)
        full = trim_stop(text, finish_reason, st.settings.no_stop_trim)
        sent = st.text[: st.sent_len]
        delta = full[len(sent) :] if full.startswith(sent) else ""
        return delta, full

    def add_text(self, out: RequestOutput) -> RequestOutput:
        """The output with its text delta (and, once finished, its whole text) filled in."""
        self.step(out.rid, out.new_token_ids)
        if out.finished:
            delta, full = self.finish(out.rid, out.finish_reason)
            return dataclasses.replace(out, text_delta=delta, text=full)
        return dataclasses.replace(out, text_delta=self.delta(out.rid))


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
            if isinstance(msg, DetokenizeSettings):
                detok.start(msg)
            elif isinstance(msg, BatchOutput):
                send_sock.send(encode(BatchOutput([detok.add_text(out) for out in msg.items])))
            elif isinstance(msg, ReqError):  # a queued request refused (its grammar): forget it, pass it on
                detok.forget(msg.rid)
                send_sock.send(encode(msg))
    except SystemExit:
        pass
    except BaseException:
        logger.critical("detokenizer crashed:\n%s", traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        ctx.destroy(linger=0)
