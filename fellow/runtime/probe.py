"""``python -m fellow.runtime.probe [--4bit-rows auto|off|N]``: the capabilities whose kernels really run on
this machine, as a JSON list on stdout. The fellow agent (torch-free) runs it once at start, with its
SWARM_SERVE_4BIT_ROWS, and declares what it prints."""

from __future__ import annotations

import argparse
import json
import logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fellow.runtime.probe")
    parser.add_argument("--4bit-rows", dest="fourbit_rows", default="auto",
                        help="the fellow's SWARM_SERVE_4BIT_ROWS: serve-4bit-rows is declared on CUDA unless off")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from fellow.runtime.model.load.fourbit_rows import capabilities
    from fellow.runtime.model.quant.probe import probe

    print(json.dumps(probe() + capabilities(torch.cuda.is_available(), args.fourbit_rows)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
