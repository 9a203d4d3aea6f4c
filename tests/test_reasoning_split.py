"""The reasoning split on its own: any cut of a reply into token texts gives the same thought and answer."""

from __future__ import annotations

import random

import pytest

from events.frames import TokenFrame
from leader.openai.reasoning import Reasoning
from leader.openai.replies import split_pieces


def run(pieces: list[str], inside: bool = False) -> tuple[str, str, int]:
    split = Reasoning(inside)
    thought, answer = "", ""
    for piece in pieces:
        t, a = split.feed(piece)
        thought, answer = thought + t, answer + a
    t, a = split.flush()
    return thought + t, answer + a, split.tokens


@pytest.mark.parametrize("raw, inside, thought, answer", [
    ("<think>\n\n</think>\n\nHello world", False, "", "Hello world"),  # Qwen3, thinking nothing
    ("<think>\nI ponder\nthis\n</think>\n\nHi <think>", False, "I ponder\nthis", "Hi <think>"),
    ("Hello <think>x</think>", False, "", "Hello <think>x</think>"),  # no block first: all answer
    ("  <thinking", False, "", "  <thinking"),
    ("a b\n</think>\n\nans", True, "a b", "ans"),  # DeepSeek-R1 style: the prompt opened the block
    ("a b </th", True, "a b </th", ""),  # cut off while thinking: all thought, nothing held back
    ("<think>\nstill thinking\n", False, "still thinking", ""),
    ("\n" * 12 + "<think>x</think>\n\nans", False, "x", "\n" * 12 + "ans"),  # a long lead is answer, the block opens
])
def test_any_cut_of_a_reply_splits_alike(raw, inside, thought, answer):
    rng = random.Random(raw)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(0, 6))))
        pieces = [raw[i:j] for i, j in zip([0] + cuts, cuts + [len(raw)])]
        assert run(pieces, inside)[:2] == (thought, answer), pieces


def test_thinking_tokens_are_counted_tags_included():
    assert run(["<think>", "\n", "x", "\n", "</think>", "\n\n", "Hi", " there"])[2] == 5
    assert run(["a", "b", "</think>", "c"], inside=True)[2] == 3
    assert run(["Hi", "<think>"])[2] == 0


def test_a_reply_of_whitespace_streams_as_answer_instead_of_being_held_to_its_end():
    """A model that does not open a block but writes newlines: a few are held (a block may still open), then
    they settle as answer as they come, not all at the reply's end (a streamed reply would arrive whole)."""
    split = Reasoning(False)
    settled = [split.feed("\n")[1] for _ in range(40)]
    assert settled[:8] == [""] * 8 and "".join(settled) == "\n" * 40 and settled[-1] == "\n"
    assert run(["\n", "\n", " <think>", "x</think>", "ans"])[:2] == ("x", "ans")  # a late block still opens


def test_a_frame_counts_its_tokens_not_its_pieces():
    """A stage sends one text per token id ("" for a token that completes no character yet), then at most
    one piece of no token (the detokenizer's tail); a prompt-logprobs frame has neither."""
    split = Reasoning(True)
    assert split_pieces(split, TokenFrame(request_id="r", seq=1, texts=[], prompt_logprobs=[None])) == ("", "")
    frame = TokenFrame(request_id="r", seq=2, texts=["a", "", "b</think>", "c", "\ufffd"], token_ids=[1, 2, 3, 4])
    assert split_pieces(split, frame) == ("ab", "c\ufffd") and split.tokens == 3
    old = Reasoning(True)  # a peer that sends text alone: each piece a token
    split_pieces(old, TokenFrame(request_id="r", seq=1, texts=["a", "</think>"]))
    assert old.tokens == 2
