"""`python -m fellow.runtime CONFIG`: one stage process. CONFIG is an events.stage.StageConfig (JSON);
the stage picks the local or the ring server for itself, and reports to its agent on stdout."""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec

from core.logs import setup_logging
from core.procs import die_with_parent
from events.stage import FailedReport, StageConfig, decode_config

log = logging.getLogger("swarm.serve")


def die_with_agent(cfg: StageConfig) -> None:
    """SIGKILL when the agent dies, however it dies; exit now if it died already."""
    die_with_parent(signal.SIGKILL)
    if cfg.agent_pid and os.getppid() != cfg.agent_pid:
        os._exit(1)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m fellow.runtime CONFIG (a StageConfig as JSON)", file=sys.stderr)
        return 2
    try:
        cfg = decode_config(argv[1])
    except msgspec.DecodeError as exc:
        print(f"not a stage config: {exc}", file=sys.stderr)
        return 2
    die_with_agent(cfg)
    # torch and the model code load after that, so a stage never outlives its agent for long
    from fellow.runtime.ring.servers import RingHeadServer, RingStageServer
    from fellow.runtime.server.base import CannotServe, report
    from fellow.runtime.server.stage import StageServer

    if cfg.options.threads > 0:
        import torch

        torch.set_num_threads(cfg.options.threads)

    setup_logging(text_format=f"%(asctime)s %(levelname)s [stage{cfg.stage} {cfg.load_id}] %(message)s",
                  fields={"stage": cfg.stage, "load_id": cfg.load_id})  # SWARM_LOG_FORMAT: text or json
    if cfg.num_stages == 1:
        server = StageServer(cfg)
    elif cfg.stage == 0:
        server = RingHeadServer(cfg)
    else:
        server = RingStageServer(cfg)
    try:
        server.load()
    except Exception as exc:
        log.exception("load failed")
        report(FailedReport(reason=str(exc) if isinstance(exc, CannotServe) else f"{type(exc).__name__}: {exc}"))
        return 1
    return server.serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
