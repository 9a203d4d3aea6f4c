"""Replies checked by a second fellow (issue 54, leader.verify), with real parts: nats-server, the leader's
SQLite, its Litestar app, fellow processes and their stages on tiny models.

A liar is a real fellow handed a different model under the same id (its model cache holds another
servable at the catalog's manifest hash): its greedy replies are not the honest scorers' argmax, it fails
checks by two different scorers and is drained, and placement then gives it no stage. Honest replicas,
greedy and sampled, raise no flag (SWARM_VERIFY_REQUESTS of them; 500 for the measured run).
"""

from __future__ import annotations

import hashlib
import os
import shutil

import httpx
import pytest

from core.nats_server import EmbeddedNats
from core.servable import MANIFEST_NAME
from tests.processes import SwarmProcess, wait_until
from tests.serving_fixtures import Stack, make_servable

HONEST_REQUESTS = int(os.environ.get("SWARM_VERIFY_REQUESTS", "60"))
FLAG_WITHIN = 30  # requests, at SWARM_VERIFY_SHARE=1, before the liar must be drained


def chat(s: Stack, i: int, temperature: float, max_tokens: int = 10) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me about item {i}."}],
            "max_tokens": max_tokens, "temperature": temperature, "seed": i}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def checks(s: Stack) -> list[tuple]:
    return s.sql("select request_id, fellow_id, scorer_id, mode, passed, worst from reply_checks")


def trust(s: Stack) -> dict[str, tuple]:
    return {r[0]: r[1:] for r in s.sql("select fellow_id, checks, failed, failed_by, drained_at from fellow_trust")}


def liar_cache(root, servable) -> dict:
    """A model cache holding another model (untied embeddings, another seed) where the honest one's would be."""
    from fellow.runtime.tools.export import export
    from tests.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(root / "hf-liar", layers=2, hidden=64, seed=12, tie_embeddings=False)
    sha = hashlib.sha256((servable / MANIFEST_NAME).read_bytes()).hexdigest()
    cache = root / "liar-cache"
    export(hf, root / "liar-servable", stages=1, model_id="tiny")
    shutil.copytree(root / "liar-servable", cache / f"tiny-{sha[:16]}")
    return {"SWARM_FELLOW_MODEL_CACHE": str(cache), "SWARM_FELLOW_FETCH": "always"}


@pytest.fixture
def nats(tmp_path):
    server = EmbeddedNats(tmp_path / "js").start()
    yield server
    server.stop()


def test_a_liar_is_flagged_by_two_scorers_and_drained(tmp_path, nats):
    _, servable = make_servable(tmp_path, "tiny", layers=2, hidden=64, stages=1, seed=11)
    s = Stack(tmp_path, nats.url, servable.parent, fellows=3, SWARM_VERIFY_SHARE=1)
    s.fellows[2] = SwarmProcess(["fellow", "--id", "f2"], {**s.env, **liar_cache(tmp_path, servable)},
                                tmp_path / "fellow2.log")
    s.start()
    try:
        load = s.load("tiny", replicas=3)
        assert {st["fellow_id"] for st in load["stages"]} == {"f0", "f1", "f2"}
        sent = 0
        while sent < FLAG_WITHIN and trust(s).get("f2", (0, 0, [], None))[3] is None:
            chat(s, sent, 0.0)
            sent += 1
        wait_until(lambda: trust(s).get("f2", (0, 0, [], None))[3] is not None, 60,
                   f"the liar drained ({trust(s)}, {checks(s)})")
        rows = checks(s)
        print(f"liar drained after {sent} requests; checks: {len(rows)}; trust: {trust(s)}")
        liar = [r for r in rows if r[1] == "f2"]
        assert liar and not any(r[4] for r in liar if r[2] != "f2"), liar  # every check of its replies failed
        assert {r[2] for r in liar} == {"f0", "f1"}
        assert all(r[4] for r in rows if "f2" not in (r[1], r[2])), rows  # honest scored by honest: passed
        assert {f for f, t in trust(s).items() if t[3] is not None} == {"f2"}  # one scorer alone drains nobody
        metrics = s.get("/metrics").text
        assert 'swarm:reply_checks_total{fellow_id="f2",model_name="tiny",outcome="failed"}' in metrics
        # drained: a new load goes on the honest fellows only
        assert s.post("/api/v1/models/tiny/unload", {"wait": True}).status_code == 200
        again = s.post("/api/v1/models/tiny/load", {"wait": True, "replicas": 3})
        assert again.status_code == 409 and again.json()["error"]["code"] == "placement_failed", again.text
        assert {st["fellow_id"] for st in s.load("tiny", replicas=2)["stages"]} == {"f0", "f1"}
    finally:
        s.stop()


def test_honest_replicas_raise_no_flag_greedy_or_sampled(tmp_path, nats):
    _, servable = make_servable(tmp_path, "tiny", layers=2, hidden=64, stages=1, seed=11)
    s = Stack(tmp_path, nats.url, servable.parent, fellows=2, SWARM_VERIFY_SHARE=1).start()
    try:
        s.load("tiny", replicas=2)
        for i in range(HONEST_REQUESTS):
            chat(s, i, 0.0 if i % 2 == 0 else 1.0)
        wait_until(lambda: len(checks(s)) >= HONEST_REQUESTS, 120, f"every reply checked ({len(checks(s))})")
        rows = checks(s)
        greedy = [r for r in rows if r[3] == "greedy"]
        sampled = [r for r in rows if r[3] == "sampled"]
        print(f"honest: {len(rows)} checks, {len(greedy)} greedy (worst gap {max(r[5] for r in greedy):.6f}),"
              f" {len(sampled)} sampled (lowest logprob {min(r[5] for r in sampled):.3f}); "
              f"scorers {sorted({(r[1], r[2]) for r in rows})}")
        assert greedy and sampled
        assert all(r[4] for r in rows), [r for r in rows if not r[4]]
        assert all(r[1] != r[2] for r in rows)  # never scored by the fellow that served it
        assert all(t[1] == 0 and t[3] is None for t in trust(s).values()), trust(s)
        wait_until(lambda: s.sql("select count(*) from requests where api = 'verify' and status = 'finished'")[0][0]
                   >= HONEST_REQUESTS, 30, "each check in the requests audit, its API 'verify'")
    finally:
        s.stop()
