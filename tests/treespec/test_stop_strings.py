"""Stop strings in one module: the scheduler's tail check, the streaming holdback, the final trim."""

from treespec.stop_strings import find_stop_in_tail, stop_holdback, streamable_end, trim_stop


class CharTokenizer:
    """One token per character: token id = code point."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def test_stop_holdback():
    assert stop_holdback("hello wor", ["world"]) == 3
    assert stop_holdback("hello", ["xyz"]) == 0
    assert stop_holdback("ab", ["abc", "b"]) == 2
    assert stop_holdback("", ["abc"]) == 0


def test_streamable_end_stops_before_a_stop_string_or_a_possible_start():
    assert streamable_end("abc END more", ["END"]) == 4
    assert streamable_end("abc EN", ["END"]) == 4
    assert streamable_end("abc", ["END"]) == 3
    assert streamable_end("abc E", []) == 5


def test_find_stop_in_tail_looks_at_the_tail_only():
    ids = [ord(c) for c in "xxSTOPxxxxxxxxxx"]
    assert find_stop_in_tail(CharTokenizer(), ids[:6], ["STOP"]) == "STOP"
    assert find_stop_in_tail(CharTokenizer(), ids, ["STOP"]) is None  # long past: already seen by then
    assert find_stop_in_tail(CharTokenizer(), ids[:6], []) is None


def test_trim_stop():
    reason = {"type": "stop", "matched": "END"}
    assert trim_stop("abc END x", reason, no_stop_trim=False) == "abc "
    assert trim_stop("abc END x", reason, no_stop_trim=True) == "abc END x"
    assert trim_stop("abc", {"type": "stop", "matched": 7}, no_stop_trim=False) == "abc"
    assert trim_stop("abc", None, no_stop_trim=False) == "abc"
