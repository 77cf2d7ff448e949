"""Stop strings against a running sample's text (serve/sequence.py): ``StopScan`` looks only at
what each decode adds, and finds what a search of the whole text finds."""

from __future__ import annotations

import random

from srm_max.serve.sequence import Sequence, StopScan, stop_prefix


def whole_text_settled(text: str, stops) -> int:
    """``settled`` by its definition: the text less a trailing U+FFFD and less the longest tail
    that is a proper prefix of a stop string, every tail tried."""
    end = len(text.rstrip("\ufffd"))
    held = max((k for s in stops for k in range(1, min(len(s) - 1, end) + 1) if text[end - k:end] == s[:k]),
               default=0)
    return end - held


def whole_text_first(text: str, stops) -> int | None:
    return min((text.find(s) for s in stops if s in text), default=None)


def growing_texts(rng: random.Random):
    """Decodes of ever more tokens: mostly extended, a trailing U+FFFD completed by the next
    token, and now and then an earlier character rewritten (a tokenizer's cleanup)."""
    text = ""
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.1 and text:
            i = rng.randrange(len(text))
            text = text[:i] + rng.choice("ab") + text[i + 1:]
        elif r < 0.3 and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd") + rng.choice("ab")
        text += "".join(rng.choice("ab\ufffd") for _ in range(rng.randint(0, 3)))
        yield text


def test_the_scan_finds_what_a_search_of_the_whole_text_finds():
    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        scan, streamed = StopScan(stops), StopScan(stops)
        for text in growing_texts(rng):
            first = scan.first(text)
            assert first == whole_text_first(text, stops), (stops, text)
            if first is not None:
                break
            expected = whole_text_settled(text, stops)
            assert streamed.settled(text) == expected, (stops, text)


def test_stop_prefix_is_the_longest_tail_that_begins_a_stop_string():
    assert stop_prefix("xxab", 4, "abc") == 2
    assert stop_prefix("xxab", 4, "ab") == 0  # "ab" is the stop string itself, not a beginning of it
    assert stop_prefix("aaaa", 4, "aaab") == 3  # the longest of the overlapping candidates
    assert stop_prefix("aaaa", 4, "aaab", start=2) == 2
    assert stop_prefix("ab\ufffd", 2, "bc") == 1


def chars(ids) -> str:
    return "".join(map(chr, ids))


def test_a_sequence_holds_back_a_tail_and_cuts_at_a_stop_string():
    """Characters as tokens: the stream shows nothing that could begin "STOP" or "xyz", and
    the text ends before the stop string."""
    s = Sequence([0], 1.0, 0, 1.0, 0, 100, stop_strings=("STOP", "xyz"))
    shown = []
    for ch in "abSTxSTO":
        assert s.accept(ord(ch), chars, 1000) and s.reason is None
        shown.append(s.stream_piece(chars))
    assert shown == ["a", "b", "", "", "ST", "x", "", ""]
    s.accept(ord("P"), chars, 1000)
    assert (s.reason, s.text(chars)) == ("stop", "abSTx")
    assert "".join(shown) + s.stream_piece(chars) == "abSTx"


class Searched(str):
    """A text that records how much of it each ``find`` looks at, by what it looks for."""

    looked: dict[str, int] = {}

    def find(self, sub, start=0, end=None):
        Searched.looked[sub] = len(self) - start
        return super().find(sub, start, end)


def test_each_call_looks_only_at_the_new_text_and_the_tail_that_could_begin_a_stop_string(monkeypatch):
    """Sixteen stop strings of 60,000 characters against a growing text: a stop string is
    searched for only where it could end in new text, and a held-back tail only from where the
    last one began, not in every prefix of every stop string."""
    from srm_max.serve import sequence

    rng = random.Random(1)
    stops = ["".join(rng.choice("abcdefgh ") for _ in range(60_000)) for _ in range(16)]
    stops[0] = "the cat " * 7500  # a text that keeps beginning it
    stops[1:3] = ["cat!", "a z"]  # short ones, searched for in the new end of the text
    windows, plain = [], sequence.stop_prefix

    def recorded(text, end, stop, start=0):
        windows.append((stop, end - max(start, end - len(stop) + 1)))
        return plain(text, end, stop, start)

    monkeypatch.setattr(sequence, "stop_prefix", recorded)
    scan, text, held, end, longest = StopScan(stops), "", dict.fromkeys(stops, 0), 0, 0
    for _ in range(300):
        new = rng.choice(["the ", "cat ", "a ", "sat "])
        text += new
        Searched.looked.clear()
        assert scan.first(Searched(text)) is None
        assert all(Searched.looked[stop] <= len(new) + len(stop) - 1 for stop in stops)
        windows.clear()
        assert scan.settled(text) == whole_text_settled(text, stops)
        for stop, window in windows:
            assert window <= held[stop] + len(text) - end
            held[stop] = plain(text, len(text), stop)
        end, longest = len(text), max(longest, *held.values())
    assert longest >= len("the cat ")  # the text did begin a stop string now and then
