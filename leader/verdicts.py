"""The gateway's own verdicts on a request whose load or replica ended: the error frame its reader gets."""

from __future__ import annotations

from events.frames import ErrorFrame
from events.loads import LoadFailed, ModelUnloaded, ReplicaLost


def not_loaded(stream, evt: ModelUnloaded) -> ErrorFrame:
    """The verdict on a request no stage started before its load was unloaded (HTTP: model_not_loaded)."""
    return ErrorFrame(request_id=stream.request_id, seq=-1, code="model_unloaded",
                      message=f"the model '{evt.model_id}' was unloaded ({evt.reason}) before this request was "
                              "served", data={"load_code": evt.reason, "fellow_id": evt.fellow_id})


def load_failed(stream, evt: LoadFailed) -> ErrorFrame:
    """The verdict on a request whose load failed, started or not (its queue is purged)."""
    return ErrorFrame(request_id=stream.request_id, seq=-1, code="load_failed",
                      message=f"the model '{evt.model_id}' stopped serving: {evt.reason}",
                      data={"load_code": evt.code, "fellow_id": evt.fellow_id})


def ended(stream, evt: ModelUnloaded | LoadFailed) -> ErrorFrame:
    return load_failed(stream, evt) if isinstance(evt, LoadFailed) else not_loaded(stream, evt)


def replica_lost(stream, evt: ReplicaLost) -> ErrorFrame:
    """The verdict on a request the replica that stopped had started."""
    return ErrorFrame(request_id=stream.request_id, seq=-1, code="load_failed",
                      message=f"the replica of '{evt.model_id}' serving this request stopped: {evt.reason}",
                      data={"load_code": evt.code, "fellow_id": evt.fellow_id, "replica": evt.replica})
