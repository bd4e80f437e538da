"""Run the OpenAI-compatible frontend: ``python -m frontend.openai [--triton-grpc HOST:PORT] [--port 9000] ...``

It starts without waiting for Triton (``/health`` and ``/health/ready`` answer 503 until Triton does), logs
"Uvicorn running on http://HOST:PORT" once it listens, answers 503 on ``/health/ready`` from SIGUSR1 on (the
launcher's word that the server is about to stop) while it goes on serving, and stops cleanly on SIGTERM or
Ctrl-C: no new connections, open streams get ``--shutdown-timeout`` seconds to finish, then their Triton requests
are cancelled; exit status 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import uvicorn

from backend.contract.settings import (
    API_KEY_ENV_VAR,
    DEFAULT_MODEL,
    DRAINING_SIGNAL,
    MODEL_ENV_VAR,
    OPENAI_PORT_ENV_VAR,
)
from frontend.openai.app import Settings, create_app, start_draining


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m frontend.openai", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--triton-grpc", default=f"127.0.0.1:{os.environ.get('GRPC_PORT') or 8001}",
                   help="host:port of Triton's gRPC frontend (default: %(default)s, $GRPC_PORT)")
    p.add_argument("--triton-metrics",
                   default=f"http://127.0.0.1:{os.environ.get('METRICS_PORT') or 8002}/metrics",
                   help="Triton's metrics page, read by /get_load (default: %(default)s, $METRICS_PORT)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=int(os.environ.get(OPENAI_PORT_ENV_VAR) or 9000),
                   help=f"port to listen on (default: %(default)s, ${OPENAI_PORT_ENV_VAR})")
    p.add_argument("--model-dir", default=os.environ.get("MODEL") or os.environ.get(MODEL_ENV_VAR) or DEFAULT_MODEL,
                   help="the model folder whose chat template renders messages (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV_VAR) or None,
                   help=f"require 'Authorization: Bearer <key>' on /v1 (default: ${API_KEY_ENV_VAR}; none: open)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds open streams may run on after SIGTERM (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        app = create_app(Settings(args.triton_grpc, args.model_dir, args.api_key, args.triton_metrics))
    except (OSError, ValueError) as exc:
        print(f"frontend.openai: cannot load the chat template from {args.model_dir}: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    server = uvicorn.Server(config)
    # NOTE: uvicorn handles SIGTERM and SIGINT while it serves, then raises the signal again under the handlers it
    # found; with these, a stop it handled ends in exit status 0 rather than death by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    signal.signal(DRAINING_SIGNAL, lambda *_: start_draining(app))
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
