"""``python -m fellow.runtime.probe``: the capabilities whose kernels really run on this machine, as a JSON
list on stdout. The fellow agent (torch-free) runs it once at start and declares what it prints."""

from __future__ import annotations

import json
import logging


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from fellow.runtime.model.quant import probe

    print(json.dumps(probe()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
