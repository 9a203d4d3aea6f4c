"""`GET /metrics`: Prometheus' text format, through prometheus_client, with vLLM's names under `swarm:`.

Counters and histograms come from the event stream: an ordered consumer reads SWARM_EVENTS from its
first message, so any leader, started at any time, serves the same totals. Gauges come from the latest
heartbeats (requests running and waiting, KV cache use, fellows and their memory) and the ring's lane
counts, read at scrape time.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import OrderedDict

from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from sqlalchemy.ext.asyncio import async_sessionmaker

from core.bus import unsubscribe_quietly
from events import subjects
from events.loads import LoadPlaced, LoadRequested
from events.requests import RequestAccepted, RequestFailed, RequestFinished
from events.union import PoisonEvent, decode_event
from events.verify import ReplyChecked
from leader.fellow_monitor import FellowMonitor
from leader.projectors.authority import Authority
from leader.relay_stats import RelayStats

log = logging.getLogger(__name__)

P = "swarm:"
# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOO_LONG = "context_too_long"
ENDS_KEPT = 100_000


class WeightedHistogram:
    """A histogram per model where one observation may count n times: a request's mean gap between tokens
    counts once per token, in constant time however long the reply (the history is folded at start)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.models: dict[str, tuple[list[int], list[float]]] = {}  # model -> (count per bucket and +Inf, [sum])

    def observe(self, model: str, value: float, times: int) -> None:
        counts, total = self.models.setdefault(model, ([0] * (len(self.buckets) + 1), [0.0]))
        counts[bisect.bisect_left(self.buckets, value)] += times
        total[0] += value * times

    def family(self) -> HistogramMetricFamily:
        out = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        for model, (counts, total) in sorted(self.models.items()):
            cumulative = list(itertools.accumulate(counts))
            bounds = [*(repr(float(b)) for b in self.buckets), "+Inf"]
            out.add_metric([model], buckets=list(zip(bounds, cumulative)), sum_value=total[0])
        return out


class Metrics:
    """The leader's registry: event-fed counters and histograms, plus a collector of live gauges."""

    def __init__(self, js: JetStreamContext, sessions: async_sessionmaker, fellows: FellowMonitor | None,
                 relay: RelayStats | None = None):
        self.js = js
        self.fellows = fellows  # the latest heartbeats, for the live gauges
        self.relay = relay  # the ring's lane counts (the serving's), if any
        self.registry = CollectorRegistry(auto_describe=False)
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of the requests that ended", m, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", m, registry=r)
        self.success = Counter(P + "request_success", "Requests that finished, by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.failure = Counter(P + "request_failure", "Requests that failed, by error code",
                               ["model_name", "code"], registry=r)
        self.too_long = Counter(P + "request_too_long", "Requests refused as longer than the load holds", m,
                                registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = WeightedHistogram(P + "inter_token_latency_seconds", "Time between tokens (once per token after "
                                     "the first, the request's mean)", ITL_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "From accepted to finished", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "Queued: on the bus, then in the stage's line",
                               m, buckets=LATENCY_BUCKETS, registry=r)
        self.checks = Counter(P + "reply_checks", "Replies checked by another fellow (leader.verify), by outcome",
                              ["model_name", "fellow_id", "outcome"], registry=r)
        r.register(_LiveGauges(self))
        self.models: dict[str, str] = {}  # load_id -> model_id
        self._accepted: dict[str, float] = {}  # request_id -> when it was accepted, until it ends
        self._ended: OrderedDict[str, None] = OrderedDict()  # the latest requests ended: a second end is not counted
        self.authority = Authority(sessions)  # what a fellow may not report is not counted
        self._sub = None

    async def start(self) -> None:
        self._sub = await self.js.subscribe(subjects.EVENTS_ALL, stream=subjects.EVENTS_STREAM,
                                            cb=self._on_msg, ordered_consumer=True)

    async def stop(self) -> None:
        await unsubscribe_quietly(self._sub)
        self._sub = None

    async def _on_msg(self, msg) -> None:
        try:
            evt = decode_event(msg.data)
        except PoisonEvent:
            evt = None  # the projectors record it as a dead letter
        if evt is not None and not await self.authority.refusal(msg.subject, evt):
            self.apply(evt)

    def apply(self, evt) -> None:
        if isinstance(evt, ReplyChecked):
            self.checks.labels(evt.model_id, evt.fellow_id, "passed" if evt.passed else "failed").inc()
        elif isinstance(evt, (LoadRequested, LoadPlaced)):
            self.models[evt.load_id] = evt.model_id
        elif isinstance(evt, RequestAccepted):
            self._accepted[evt.request_id] = evt.at
        elif isinstance(evt, (RequestFinished, RequestFailed)) and not self._first_end(evt.request_id):
            return  # the gateway and the stage may both report a failure: the first counts, as in SQL
        elif isinstance(evt, RequestFinished):
            self._finished(evt)
        elif isinstance(evt, RequestFailed):
            self._accepted.pop(evt.request_id, None)
            model = evt.model_id
            self.prompt_tokens.labels(model).inc(evt.prompt_tokens)
            self.generation_tokens.labels(model).inc(evt.completion_tokens)
            self.failure.labels(model, evt.code).inc()
            if evt.code == TOO_LONG:
                self.too_long.labels(model).inc()

    def _first_end(self, request_id: str) -> bool:
        if request_id in self._ended:
            return False
        self._ended[request_id] = None
        if len(self._ended) > ENDS_KEPT:
            self._ended.popitem(last=False)
        return True

    def _finished(self, evt: RequestFinished) -> None:
        model = evt.model_id
        accepted = self._accepted.pop(evt.request_id, None)
        self.prompt_tokens.labels(model).inc(evt.prompt_tokens)
        self.generation_tokens.labels(model).inc(evt.completion_tokens)
        self.success.labels(model, evt.finish_reason).inc()
        self.e2e.labels(model).observe(max(0.0, evt.at - accepted) if accepted is not None else evt.duration_s)
        queue_ms = evt.timing.get("queue_ms")
        if isinstance(queue_ms, (int, float)):
            self.queue.labels(model).observe(queue_ms / 1e3)
        if evt.ttft_s is not None:
            self.ttft.labels(model).observe(evt.ttft_s)
            if evt.completion_tokens > 1:
                gap = max(0.0, evt.duration_s - evt.ttft_s) / (evt.completion_tokens - 1)
                self.itl.observe(model, gap, evt.completion_tokens - 1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _LiveGauges:
    """Read at scrape time: the latest heartbeat of each online fellow, the ring's lane counts, and the
    inter-token histogram."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        monitor = self.metrics.fellows
        beats = [hb for fid, hb in (monitor.latest.items() if monitor else [])
                 if monitor.online.get(fid) == hb.started_at]
        stage_labels = ["model_name", "fellow", "stage", "replica"]
        running = GaugeMetricFamily(P + "num_requests_running", "Requests a stage is serving", labels=stage_labels)
        waiting = GaugeMetricFamily(P + "num_requests_waiting", "Requests taken by a stage, waiting to start",
                                    labels=stage_labels)
        kv = GaugeMetricFamily(P + "kv_cache_usage_perc", "Share of the stage's KV tokens reserved (1 = full)",
                               labels=stage_labels)
        online = GaugeMetricFamily(P + "fellows_online", "Fellows sending heartbeats")
        mem_total = GaugeMetricFamily(P + "fellow_memory_total_bytes", "A fellow's memory (system, or its GPUs')",
                                      labels=["fellow", "device"])
        mem_free = GaugeMetricFamily(P + "fellow_memory_free_bytes", "A fellow's free memory",
                                     labels=["fellow", "device"])
        online.add_metric([], len(beats))
        for hb in beats:
            mem_total.add_metric([hb.fellow_id, "system"], hb.memory_total_bytes)
            mem_free.add_metric([hb.fellow_id, "system"], hb.memory_free_bytes)
            for gpu in hb.gpus:
                mem_total.add_metric([hb.fellow_id, f"gpu{gpu.index}"], gpu.total_bytes)
                mem_free.add_metric([hb.fellow_id, f"gpu{gpu.index}"], gpu.free_bytes)
            for lm in hb.loaded_models:
                labels = [lm.model_id, hb.fellow_id, str(lm.stage), str(lm.replica)]
                running.add_metric(labels, lm.in_flight)
                waiting.add_metric(labels, lm.waiting)
                if lm.kv_tokens:
                    kv.add_metric(labels, lm.kv_tokens_used / lm.kv_tokens)
        yield from (running, waiting, kv, online, mem_total, mem_free, self.metrics.itl.family())
        yield from self._lanes()

    def _lanes(self):
        labels = ["model_name", "load", "stage", "lane"]
        sent = CounterMetricFamily(P + "ring_link_bytes", "Bytes a ring stage sent, per lane", labels=labels)
        frames = CounterMetricFamily(P + "ring_link_frames", "Frames a ring stage sent, per lane", labels=labels)
        relay = self.metrics.relay
        for load_id, stages in (list(relay.loads.items()) if relay is not None else []):
            model = self.metrics.models.get(load_id, "")
            for (_, stage), stats in sorted(stages.items()):  # a ring replica's lanes carry its prefix (r1-act)
                for lane, (nbytes, count) in sorted(stats.lanes.items()):
                    sent.add_metric([model, load_id, str(stage), lane], nbytes)
                    frames.add_metric([model, load_id, str(stage), lane], count)
        yield from (sent, frames)
