"""The agent and a stage process talk in typed messages: a StageConfig in, ready/metrics/failed reports out."""

from __future__ import annotations

import msgspec
import pytest

from events.stage import (
    FailedReport,
    MetricsReport,
    ReadyReport,
    StageConfig,
    StageOptions,
    decode_config,
    decode_report,
    encode,
)


def test_a_stage_config_round_trips_with_every_field():
    cfg = StageConfig(load_id="ld-1", model_id="tiny", model_dir="/m/tiny", nats_url="nats://h:4222", fellow_id="f0",
                      stage=1, num_stages=3, replica=2, replicas=4,
                      options=StageOptions(max_in_flight=16, kv_tokens=9000, max_batch=4, prefill_chunk=128,
                                           packed_linear=False, compile=(1, 8), devices="cuda:0,cpu"),
                      report_s=0.5, agent_pid=1234)
    assert decode_config(encode(cfg)) == cfg
    assert decode_config(encode(cfg).decode()) == cfg  # as it comes in argv


def test_a_minimal_stage_config_takes_the_defaults():
    cfg = decode_config(b'{"load_id":"ld","model_id":"m","model_dir":"/d","nats_url":"nats://x","fellow_id":"f"}')
    assert (cfg.stage, cfg.num_stages, cfg.replica, cfg.replicas) == (0, 1, 0, 1)
    assert cfg.options == StageOptions() and cfg.options.prefill_chunk == 256 and cfg.options.packed_linear


@pytest.mark.parametrize("report", [
    ReadyReport(kv_tokens=4096, kv_tokens_planned=8192, max_in_flight=8, vram_bytes=123, load_s=1.5),
    MetricsReport(tokens_per_s=12.5, last_ttft_s=0.02, requests=3, idle_s=4.0, vram_bytes=99, in_flight=1,
                  waiting=2),
    MetricsReport(),
    FailedReport(reason="the ring's later stages did not answer within 600s"),
])
def test_each_report_round_trips_as_one_tagged_line(report):
    line = encode(report)
    assert b"\n" not in line
    assert decode_report(line) == report
    assert type(decode_report(line)) is type(report)


@pytest.mark.parametrize("line", [b"not json", b'{"event":"exited","code":0}', b'{"event":"ready"}',
                                  b'{"event":"failed","reason":5}', b'{"kv_tokens":1}'])
def test_a_line_that_is_no_report_is_refused(line):
    with pytest.raises(msgspec.DecodeError):
        decode_report(line)


def test_a_config_of_the_wrong_shape_is_refused():
    with pytest.raises(msgspec.DecodeError):
        decode_config(b'{"load_id":"ld","model_id":"m"}')
    with pytest.raises(msgspec.DecodeError):
        decode_config(b'{"load_id":"ld","model_id":"m","model_dir":"/d","nats_url":"n","fellow_id":"f",'
                      b'"options":{"kv_tokens":"many"}}')
