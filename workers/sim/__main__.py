"""`python -m workers.sim ...`: run the simulated vLLM server (flags: see `workers.sim.config`).

The only place the sim reads the environment: PYTHONHASHSEED, which vLLM uses as the NONE_HASH
seed for block hashes when set (vLLM's PYTHONHASHSEED), so the sim's published hashes match vLLM's; and
VLLM_NIXL_SIDE_CHANNEL_HOST/PORT, where a vLLM-flavor prefill serves its KV (vLLM's NixlConnector); and
VLLM_ALLOW_RUNTIME_LORA_UPDATING, which adds the LoRA load/unload routes (workers/sim/adapters.py).
"""

from __future__ import annotations

import gc
import os
import sys

from workers.sim.config import parse_args


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv if argv is not None else sys.argv[1:], hash_seed=os.environ.get("PYTHONHASHSEED"), env=os.environ)
    import uvicorn

    from workers.sim.server import build_app

    app = build_app(cfg)
    # The tokenizer vocabulary and precomputed text are permanent: keep them out of the cyclic GC's
    # full collections, which would otherwise stall the engine loop for milliseconds now and then.
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False, timeout_keep_alive=30,
                loop=cfg.uvicorn_loop, http=cfg.uvicorn_http)


if __name__ == "__main__":
    main()
