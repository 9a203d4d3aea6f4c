"""The tests a scored reply must pass, pure functions of the scorer's prompt logprobs (no torch).

The scorer ran prompt + reply teacher-forced and gave, for each reply token, its logprob under the raw
logits, its rank and the likeliest candidate (``TokenLogprob`` with one top candidate).

- **Greedy** (temperature 0 or top_k 1): every token must be the scorer's argmax, or within
  ``GREEDY_MARGIN`` nats of it. Two honest stages compute the same weights with different kernels (a
  decode step against one prefill, batched against alone, compiled against eager; int8 and int4 stages
  the same quantized rows): their logits differ by float rounding, so a near-tie may flip. 0.1 nats is a
  probability ratio of 0.905 to the argmax; the honest runs measured a largest gap of 0 (float32) and
  the tiny liar's tokens sat 0.7 to 1.5 nats below the argmax (docs/verification.md).
- **Sampled**: every token must have a logprob above a floor chosen so that an honest sampler draws a
  token below it with probability at most ``SAMPLED_DELTA`` per token. Temperature T <= 1 sharpens the
  distribution, and top-k, top-p and min-p keep a top set and renormalise: in each case the chance to
  draw any token whose raw probability is under eps is at most V * eps (V the vocabulary). So the floor
  is log(delta / V); for T > 1 it is T * log(delta / V) - log V. It catches replies of tokens the model
  would (almost) never say, not a model as flat as the scorer's (a tiny random one is near uniform).

Requests whose logits a processor changes (penalties, logit bias, min_tokens, a grammar) are not checked:
the raw logits do not describe what was sampled.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from events.frames import TokenLogprob
from events.requests import ChatRequest

GREEDY_MARGIN = 0.1  # nats below the argmax a greedy token may sit (a near-tie)
SAMPLED_DELTA = 1e-6  # the most an honest sampled token fails the floor, per token


@dataclass(frozen=True)
class Verdict:
    mode: str  # greedy | sampled
    passed: bool
    tokens: int
    bad: int
    first_bad: int
    worst: float  # greedy: the largest gap to the argmax; sampled: the lowest logprob


def chosen(request_id: str, share: float) -> bool:
    """Whether a request is checked: the same answer on every leader (a hash of its id, not a draw)."""
    if share <= 0:
        return False
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) / 2**32 < share


def checkable(chat: ChatRequest) -> bool:
    """A reply whose tokens the raw logits describe: no processor changed them, and not a check itself."""
    return not (chat.sampling.adjusts or chat.not_by or chat.scored_ids or chat.max_tokens <= 0)


def sampled_floor(temperature: float, vocab: int, delta: float = SAMPLED_DELTA) -> float:
    base = math.log(delta / max(vocab, 1))
    return base if temperature <= 1.0 else temperature * base - math.log(max(vocab, 1))


def greedy_gap(entry: TokenLogprob) -> float:
    if entry.rank == 1 or not entry.top_logprobs:
        return 0.0
    return max(0.0, entry.top_logprobs[0].logprob - entry.logprob)


def judge(chat: ChatRequest, reply: list[int], scored: list[TokenLogprob | None], vocab: int) -> Verdict:
    """The verdict on ``reply`` (the served token ids) from ``scored``, the scorer's entries for them."""
    if len(scored) != len(reply) or any(e is None for e in scored):
        return Verdict("greedy" if chat.sampling.greedy else "sampled", False, len(reply), len(reply), 0, 0.0)
    if chat.sampling.greedy:
        gaps = [greedy_gap(e) for e in scored]
        bad = [i for i, g in enumerate(gaps) if g > GREEDY_MARGIN]
        return Verdict("greedy", not bad, len(reply), len(bad), bad[0] if bad else -1, max(gaps, default=0.0))
    floor = sampled_floor(chat.sampling.temperature, vocab)
    lps = [e.logprob for e in scored]
    bad = [i for i, lp in enumerate(lps) if lp < floor]
    return Verdict("sampled", not bad, len(reply), len(bad), bad[0] if bad else -1, min(lps, default=0.0))
