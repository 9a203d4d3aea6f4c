"""Where a moved request goes on (leader.moves, events.moves) and how its next stage claims it
(fellow.token_batcher): real nats-server for the claim, plain frames for the rest."""

from __future__ import annotations

import msgspec
import torch

from events import subjects
from events.frames import DoneFrame, StartFrame, TokenFrame
from events.moves import MAX_MOVES, Resume
from events.requests import ChatMessage, ChatRequest, Sampling
from fellow.runtime.engine.processors import processed
from fellow.runtime.engine.serving_loop import Job, _Reply
from fellow.runtime.engine.session import Session
from fellow.runtime.server.moved import count_once, resumed
from fellow.token_batcher import TokenBatcher
from leader.moves import resume_of, unmovable

CHAT = ChatRequest(request_id="rq-m", load_id="ld-m", model_id="m", messages=[ChatMessage(role="user", content="hi")],
                   max_tokens=10, sampling=Sampling(temperature=0.0, min_tokens=4))


def tokens(seq: int, ids: list[int], texts: list[str]) -> TokenFrame:
    return TokenFrame(request_id="rq-m", seq=seq, texts=texts, token_ids=ids)


def test_a_resume_holds_the_reply_so_far_and_how_much_of_its_text_was_sent():
    frames = [(5, StartFrame(request_id="rq-m", seq=0, fellow_id="f0")), (6, tokens(1, [7, 8], ["a", "b"])),
              (9, tokens(2, [9, 10], ["c", ""])), (9, tokens(2, [9, 10], ["c", ""]))]
    resume = resume_of(CHAT, frames)
    assert resume == Resume(seq=3, after=9, reply_ids=[7, 8, 9, 10], text_sent=3, moves=1)
    again = msgspec.structs.replace(CHAT, resume=resume)
    assert resume_of(again, frames).moves == 2


def test_a_request_ended_cut_short_or_done_does_not_move():
    start = (1, StartFrame(request_id="rq-m", seq=0, fellow_id="f0"))
    assert resume_of(CHAT, [start, (2, DoneFrame(request_id="rq-m", seq=1, completion_tokens=0,
                                                 prompt_tokens=3))]) == "its reply has ended"
    assert resume_of(CHAT, [start, (3, tokens(2, [1], ["x"]))]) == "its frames on the stream have a gap"
    assert resume_of(CHAT, []) == Resume(seq=0, after=0, reply_ids=[], moves=1)  # still queued: afresh
    assert resume_of(CHAT, [start, (2, tokens(1, list(range(10)), ["x"] * 10))]) == "its reply has all its tokens"


def test_what_a_move_cannot_keep_is_named_and_moves_are_bounded():
    assert unmovable(CHAT) == ""
    assert unmovable(None) == "the gateway does not hold it"
    assert unmovable(msgspec.structs.replace(CHAT, stop=["x"], sampling=Sampling(
        grammar="g", presence_penalty=0.5, frequency_penalty=0.5))) == ""  # rebuilt at the next stage
    assert unmovable(msgspec.structs.replace(CHAT, sampling=Sampling(prompt_logprobs=1))) == "its prompt's logprobs"
    moved = msgspec.structs.replace(CHAT, resume=Resume(seq=3, after=9, reply_ids=[1], moves=MAX_MOVES))
    assert unmovable(moved) == f"it moved {MAX_MOVES} times already"


def test_the_next_stage_prefills_the_reply_and_counts_each_token_once():
    moved = msgspec.structs.replace(CHAT, resume=Resume(seq=3, after=9, reply_ids=[7, 8, 9]))
    req, ids = resumed(moved, [1, 2])
    assert ids == [1, 2, 7, 8, 9] and req.max_tokens == 7 and req.sampling.min_tokens == 1

    class Out:
        completion_tokens, prompt_tokens, timing = 7, 5, {"cached_tokens": 5}
    out = Out()
    count_once(out, 3)
    assert (out.completion_tokens, out.prompt_tokens, out.timing["cached_tokens"]) == (10, 2, 2)


class Bytes:
    """A byte-level tokenizer: id i is byte i."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def moved_reply(prompt: list[int], earlier: list[int], text_sent: int, stop: list[str]) -> _Reply:
    """The next stage's reply state for a moved request whose ``earlier`` ids had ``text_sent`` chars out."""
    return _Reply(Job("rq-m", prompt + earlier, 10, Sampling(), stop, len(earlier), text_sent), Bytes())


def emitted(reply: _Reply, ids: list[int]) -> tuple[str, bool]:
    out, hit = "", False
    for token in ids:
        text, hit = reply.feed(reply.detok.add(token))
        out += text
        if hit:
            break
    return out, hit


def test_a_reply_cut_mid_character_goes_on_with_that_character_whole():
    euro = list("€".encode())  # three bytes: the first two came as "" texts before the move
    reply = moved_reply([104, 105], [97, *euro[:2]], 1, [])
    assert reply.pending == "" and emitted(reply, [euro[2], 33]) == ("€!", False)


def test_text_held_back_for_a_stop_string_is_held_again_after_a_move():
    # "xab" came, "x" went out: "ab" may start the stop string "abc", so the client lacks it
    earlier = list(b"xab")
    reply = moved_reply([104, 105], earlier, 1, ["abc"])
    assert reply.pending == "ab"
    assert emitted(reply, list(b"c")) == ("", True)  # the stop string, whole across the move
    again = moved_reply([104, 105], earlier, 1, ["abc"])
    assert emitted(again, list(b"d!")) == ("abd!", False)  # not it: the held text comes out first


def test_penalties_count_the_reply_made_before_the_move():
    logits = torch.zeros(1, 8)
    here = Session("s", [1, 2, 5, 5], 4, sampling=Sampling(presence_penalty=1.0, frequency_penalty=0.5),
                   earlier_ids=[5, 5])
    scores = processed(logits, [here])[0]
    assert scores[5] == -2.0 and scores[1] == 0.0  # the prompt's own ids are not output
    straight = Session("s", [1, 2], 4, sampling=here.sampling)
    straight.output_ids = [5, 5]
    assert torch.equal(processed(logits, [straight])[0], scores)


async def test_only_one_stage_claims_a_moved_request_right_after_its_last_frame(nc, js):
    first = TokenBatcher(nc, js, "rq-moved")
    assert await first.start("f0", 0) is True
    first.done(0, 1, "stop", {})
    await first.closed.wait()
    last = await js.get_last_msg(subjects.TOKENS_STREAM, subjects.tokens("rq-moved"))
    a, b = TokenBatcher(nc, js, "rq-moved"), TokenBatcher(nc, js, "rq-moved")
    assert await a.start("f1", 1, seq=2, after=last.seq) is True
    assert await b.start("f0", 0, seq=2, after=last.seq) is False  # the subject moved on: not its to serve
    a.add(["x"], [5])
    a.done(1, 1, "stop", {})
    await a.closed.wait()
    stored = await js.get_last_msg(subjects.TOKENS_STREAM, subjects.tokens("rq-moved"))
    assert stored.seq > last.seq and b"done" in stored.data


def test_a_seeded_sampled_reply_goes_on_after_a_move_as_it_would_have():
    """A stage that takes a moved seeded request (``resumed``: its prompt, the reply so far, ``Sampling.drawn``)
    samples the rest as the uninterrupted reply did: its generator skipped the draws of the tokens sent. With
    the draws not skipped the rest differs (the test sees the difference)."""
    import torch
    import transformers

    from fellow.runtime.engine.engine import local_engine
    from fellow.runtime.engine.session import Session
    from fellow.runtime.model.stage import StageModel
    from tests.test_runtime_speculative import TEXT, run

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    stage = StageModel.from_causal_lm(transformers.AutoModelForCausalLM.from_config(config).eval())
    prompt = TEXT[:20]
    for params in (Sampling(temperature=1.0, seed=11), Sampling(temperature=0.9, top_k=40, top_p=0.9, seed=3)):
        whole, _ = run(local_engine(stage, kv_tokens=4096), [Session("w", prompt, 40, params)])
        sent = whole["w"][:15]
        moved = msgspec.structs.replace(CHAT, sampling=params, max_tokens=40,
                                        resume=Resume(seq=3, after=9, reply_ids=sent, moves=1))
        req, ids = resumed(moved, list(prompt))
        assert ids == prompt + sent and req.sampling.drawn == 15 and req.max_tokens == 25
        rest, _ = run(local_engine(stage, kv_tokens=4096), [Session("m", ids, req.max_tokens, req.sampling)])
        assert sent + rest["m"] == whole["w"]
        fresh = msgspec.structs.replace(req.sampling, drawn=0)
        unskipped, _ = run(local_engine(stage, kv_tokens=4096), [Session("u", ids, req.max_tokens, fresh)])
        assert unskipped["u"] != rest["m"]
