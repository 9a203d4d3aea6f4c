"""The dashboard's JSON (performance, requests, loads) and the pages' routes, through the real app and bus."""

from __future__ import annotations

import asyncio
import time

from core.bus import settle
from events.fellow import Gpu, Heartbeat, LoadedModel
from events.requests import RequestAccepted, RequestFailed, RequestFinished
from leader.db.tables import Load, LoadStage
from leader.web.performance import topology
from tests.tokens_app import bearer, leader_client, mint, on_app

PERF = "/api/v1/models/m1/performance"


def request_events(now: float) -> list:
    """Requests of model m1 spread over the window (and one before it), plus one of another model."""
    evts = []

    def finished(rid, model, at, took, prompt, completion, reason="stop", timing=None):
        evts.append(RequestAccepted(request_id=rid, model_id=model, load_id="ld-1", at=at - took))
        evts.append(RequestFinished(request_id=rid, model_id=model, load_id="ld-1", at=at, prompt_tokens=prompt,
                                    completion_tokens=completion, finish_reason=reason, ttft_s=took / 10,
                                    duration_s=took, tokens_per_s=completion / took, timing=timing or {}))

    finished("r-old", "m1", now - 1500, 2.0, 7, 70)
    finished("r-a", "m1", now - 190, 1.0, 5, 10,
             timing={"stage0_ms": 10.0, "link_ms": 4.0, "stage1_ms": 20.0, "prefill_ms": 40.0, "route": "relay"})
    finished("r-b", "m1", now - 70, 3.0, 6, 30,
             timing={"stage0_ms": 20.0, "link_ms": 2.0, "stage1_ms": 30.0, "prefill_ms": 60.0, "route": "relay",
                     "cached_tokens": 3, "spec_k": 4, "spec_passes": 5, "spec_tokens": 15, "spec_drafted": 20,
                     "spec_accepted": 10})
    finished("r-c", "m1", now - 5, 0.5, 4, 3, reason="cancelled", timing={"stage0_ms": 5.0, "route": "local"})
    finished("r-spec", "m3", now - 8, 0.5, 4, 11, timing={"decode_ms": 6.0, "decode_passes": 4, "spec_k": 4})
    finished("r-other", "m2", now - 5, 1.0, 9, 90)
    evts.append(RequestAccepted(request_id="r-long", model_id="m1", load_id="ld-1", at=now - 20))
    evts.append(RequestFailed(request_id="r-long", model_id="m1", load_id="ld-1", at=now - 19,
                              code="context_too_long", message="needs 9000 tokens", prompt_tokens=9000))
    evts.append(RequestAccepted(request_id="r-live", model_id="m1", load_id="ld-1", at=now - 1))
    return evts


async def test_performance_buckets_and_totals_match_the_requests_made(tmp_path, nats_server, sqlite_url):
    for model in ("m1", "m2", "m3"):  # a folder without a manifest: cataloged, unavailable, still a model
        (tmp_path / "servables" / model).mkdir(parents=True)
    async with leader_client(tmp_path, nats_server.url, sqlite_url,
                             SWARM_SERVABLE_MODELS_ROOT=tmp_path / "servables") as (app, c):
        leader = app.state.leader
        evts = request_events(time.time())
        for evt in evts:
            await on_app(c, leader.publish, evt, ["requests"])
        perf = (await c.get(PERF)).json()
        spec = (await c.get("/api/v1/models/m3/performance")).json()["totals"]

    since, bucket_s = perf["since"], perf["bucket_s"]
    assert perf["window_s"] == 900 and bucket_s == 60 and len(perf["buckets"]) == 15
    assert [b["t"] for b in perf["buckets"]] == [since + i * 60 for i in range(15)]
    ended = {e.request_id: e for e in evts if isinstance(e, (RequestFinished, RequestFailed))}
    inside = {rid: e for rid, e in ended.items() if e.model_id == "m1" and e.at >= since}
    assert set(inside) == {"r-a", "r-b", "r-c", "r-long"}
    t = perf["totals"]
    assert t["requests"] == len(inside) + 1  # + r-live, still in flight
    assert (t["finished"], t["cancelled"], t["too_long"], t["failed"], t["in_flight"]) == (2, 1, 1, 0, 1)
    assert t["completion_tokens"] == sum(e.completion_tokens for e in inside.values())
    assert t["prompt_tokens"] == sum(e.prompt_tokens for e in inside.values())
    assert t["routes"] == {"relay": 2, "local": 1} and t["error_codes"] == {"context_too_long": 1}

    # Each request sits in the minute it ended; the buckets add up to the totals.
    for rid, e in inside.items():
        bucket = perf["buckets"][int((e.at - since) // bucket_s)]
        assert bucket["requests"] >= 1 and bucket["completion_tokens"] >= e.completion_tokens, (rid, bucket)
    for key in ("requests", "finished", "cancelled", "too_long", "completion_tokens", "prompt_tokens"):
        assert sum(b[key] for b in perf["buckets"]) == t[key], key

    # The split per token is weighted by each request's tokens: a long reply counts for more.
    timed = [e for e in inside.values() if isinstance(e, RequestFinished) and e.timing]
    for part in ("stage0_ms", "link_ms", "stage1_ms"):
        having = [e for e in timed if part in e.timing]
        want = sum(e.timing[part] * e.completion_tokens for e in having) / sum(e.completion_tokens for e in timed)
        assert abs(t["split_ms"][part] - want) < 1e-3, part
    assert list(t["split_ms"]) == ["stage0_ms", "link_ms", "stage1_ms"]  # ring order
    ttfts = [e.ttft_s * 1e3 for e in inside.values() if isinstance(e, RequestFinished)]
    assert abs(t["ttft_ms"] - sum(ttfts) / len(ttfts)) < 1e-3
    # the prefix cache's hit rate: prompt tokens it served over prompt tokens read, per minute and in all
    assert t["cached_tokens"] == 3 and t["prefix_hit_rate"] == round(3 / t["prompt_tokens"], 4)
    hit = perf["buckets"][int((inside["r-b"].at - since) // bucket_s)]
    assert hit["prefix_hit_rate"] == round(3 / hit["prompt_tokens"], 4)
    assert [b["prefix_hit_rate"] for b in perf["buckets"] if not b["prompt_tokens"]] == \
        [None] * sum(not b["prompt_tokens"] for b in perf["buckets"])
    assert t["spec_acceptance"] == 0.5 and t["spec_tokens_per_pass"] == 3.0  # r-b alone drafted
    assert perf["buckets"][0]["spec_acceptance"] is None
    assert spec["split_ms"] == {"stage0_ms": 6.0 * 4 / 10}  # 4 passes of 6 ms gained 10 tokens after the first
    assert perf["load"] is None  # nothing loaded


async def test_requests_and_loads_lists(tmp_path, nats_server, sqlite_url):
    (tmp_path / "servables" / "m1").mkdir(parents=True)
    async with leader_client(tmp_path, nats_server.url, sqlite_url,
                             SWARM_SERVABLE_MODELS_ROOT=tmp_path / "servables") as (app, c):
        evts = request_events(time.time())
        for evt in evts:
            await on_app(c, app.state.leader.publish, evt, ["requests"])
        every = (await c.get("/api/v1/requests", params={"limit": 100})).json()["data"]
        newest = (await c.get("/api/v1/requests", params={"limit": 3, "model": "m1"})).json()["data"]
        assert (await c.get("/api/v1/requests", params={"limit": 0})).status_code == 400
        assert (await c.get(PERF, params={"window_s": 5})).status_code == 400
        assert (await c.get("/api/v1/models/nope/performance")).json()["error"]["code"] == "model_not_found"
        loads = (await c.get("/api/v1/loads")).json()

    accepted = sorted((e for e in evts if isinstance(e, RequestAccepted)), key=lambda e: -e.at)
    assert [r["id"] for r in every] == [e.request_id for e in accepted]
    assert [r["id"] for r in newest] == [e.request_id for e in accepted if e.model_id == "m1"][:3]
    by_id = {r["id"]: r for r in every}
    assert by_id["r-long"]["status"] == "too_long" and by_id["r-long"]["error_code"] == "context_too_long"
    assert by_id["r-c"]["finish_reason"] == "cancelled" and by_id["r-live"]["status"] == "accepted"
    assert by_id["r-a"]["timing"]["link_ms"] == 4.0
    assert loads == {"object": "list", "data": []}


async def test_pages_are_public_and_the_data_is_not(tmp_path, nats_server, sqlite_url):
    async with leader_client(tmp_path, nats_server.url, sqlite_url) as (app, c):
        root = await c.get("/", follow_redirects=False)
        assert root.status_code in (301, 302, 303, 307) and root.headers["location"] == "/pools/local/default/inference"
        admin = (await mint(c, "ops", ["read"]))["token"]  # enforcement is on from here
        for page in ("inference", "dashboard"):
            html = (await c.get(f"/pools/local/default/{page}")).text
            for asset in ("swarm.js", "swarm.css", f"{page}.js"):
                assert f"/static/{asset}?v=" in html, (page, asset)
            assert 'id="token-input"' in html and "://" not in html  # nothing from elsewhere: works offline
        for asset in ("swarm.js", "inference.js", "dashboard.js", "charts.js", "swarm.css"):
            got = await c.get(f"/static/{asset}")
            assert got.status_code == 200 and len(got.content) > 500, asset
        assert (await c.get("/pools/someone/else/inference")).status_code == 404
        assert (await c.get("/api/v1/requests")).status_code == 401
        assert (await c.get("/api/v1/loads", headers=bearer(admin))).status_code == 200
        assert (await c.get("/api/v1/requests", headers=bearer(admin))).status_code == 200


async def test_a_request_in_flight_is_cancelled_at_once_by_its_own_token(tmp_path, nats_server, nc, sqlite_url):
    """POST /api/v1/requests/{id}/cancel: the stage's cancel subject hears it now; ended, unknown or
    someone else's requests are refused with OpenAI's error object."""
    (tmp_path / "servables" / "m1").mkdir(parents=True)
    heard = asyncio.Queue()

    async def on_cancel(msg):
        heard.put_nowait(msg.subject)

    sub = await nc.subscribe("swarm.cancel.ld-1.*", cb=on_cancel)
    await settle(nc)
    async with leader_client(tmp_path, nats_server.url, sqlite_url,
                             SWARM_SERVABLE_MODELS_ROOT=tmp_path / "servables") as (app, c):
        admin = (await mint(c, "ops", ["admin"]))["token"]
        mine, other = await mint(c, "me", ["operate"], admin), await mint(c, "them", ["operate"], admin)
        now = time.time()
        for evt in (RequestAccepted(request_id="r-live", model_id="m1", load_id="ld-1", at=now, token_id=mine["id"]),
                    *request_events(now)[:2]):
            await on_app(c, app.state.leader.publish, evt, ["requests"])
        cancel = "/api/v1/requests/{}/cancel".format
        refused = await c.post(cancel("r-live"), headers=bearer(other["token"]))
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "request_not_found"
        assert heard.empty()
        done = await c.post(cancel("r-live"), headers=bearer(mine["token"]))
        assert done.status_code == 200 and done.json()["status"] == "cancelling"
        assert await asyncio.wait_for(heard.get(), 10) == "swarm.cancel.ld-1.r-live"
        ended = await c.post(cancel("r-old"), headers=bearer(admin))  # an admin may cancel anyone's
        assert ended.status_code == 409 and ended.json()["error"]["code"] == "request_ended"
        assert (await c.post(cancel("nope"), headers=bearer(admin))).json()["error"]["code"] == "request_not_found"
        assert (await c.post(cancel("r-live"))).status_code == 401
    await sub.unsubscribe()


def test_topology_of_a_ring_names_each_stage_gpus_and_links():
    load = Load(load_id="ld-r", model_id="m1", state="ready", num_stages=2, transport={"max_in_flight": 4})
    stages = [LoadStage(load_id="ld-r", stage=i, fellow_id=f, layer_first=i * 2, layer_last=i * 2 + 2, state="ready",
                        kv_tokens=4096, max_in_flight=4, vram_bytes=1 << 30) for i, f in enumerate(["pc1", "pc2"])]
    gpu = Gpu(index=0, name="NVIDIA GeForce GTX 1660 SUPER", total_bytes=6 << 30, free_bytes=2 << 30)
    latest = {f: Heartbeat(fellow_id=f, hostname=f"host-{f}", seq=1, interval_s=1.0, gpus=[gpu] * (i + 1),
                           loaded_models=[LoadedModel(load_id="ld-r", model_id="m1", stage=i, state="ready",
                                                      tokens_per_s=10.0 + i, in_flight=i)])
              for i, f in enumerate(["pc1", "pc2"])}
    split = {"stage0_ms": 40.0, "link_ms": 20.0, "stage1_ms": 55.0}
    lanes = {"act": {"stage": 0, "bytes": 64_000, "frames": 500}, "tok": {"stage": 1, "bytes": 4_000, "frames": 500}}
    ring = topology(load, stages, latest, split, lanes)
    assert [(s["stage"], s["fellow_id"], len(s["gpus"]), s["ms_per_token"]) for s in ring["stages"]] == [
        (0, "pc1", 1, 40.0), (1, "pc2", 2, 55.0)]
    assert ring["stages"][1]["gpus"][0]["name"] == gpu.name and ring["stages"][1]["tokens_per_s"] == 11.0
    assert [(lk["from_fellow"], lk["to_fellow"], lk["carries"], lk["bytes"], lk["frames"]) for lk in ring["links"]] == [
        ("pc1", "pc2", "hidden", 64_000, 500), ("pc2", "pc1", "token", 4_000, 500)]
    assert ring["link_ms"] == 20.0 and ring["num_stages"] == 2
    alone = topology(load, stages[:1], latest, split)  # a ring of one: no links
    assert alone["links"] == [] and topology(None, [], latest, split) is None
