"""Serve a model over HTTP: SGLang's native /generate and the OpenAI-compatible /v1 API.

  .venv/bin/python scripts/serve.py                      # embedded SmolLM2 on 127.0.0.1:30000
  .venv/bin/python scripts/serve.py --model=/ckpt --port=8000 --api_key=secret

A mesh over several processes: the same flags plus --nnodes=N --node_rank=R
--dist_init_addr=HOST:PORT in each (rank 0 serves HTTP; docs/moe_and_mesh.md).

Flags carry SGLang's names in snake_case, one per field of runtime/server_args.ServerArgs.
/health answers 503 until warm-up is done.
SIGTERM or Ctrl-C: stop accepting, let in-flight requests finish, exit 0.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import multihost  # noqa: E402
from runtime.arg_flags import args_from_flags, define_flags  # noqa: E402
from runtime.server import serve  # noqa: E402

define_flags()  # one flag per ServerArgs field: its name, default and help


def main(argv: list[str]) -> None:
    del argv
    # Replaces absl's root handler, whose --verbosity would apply to every logger; orbax
    # (restore steps, through absl) and jax ("no TPU backend") stay at WARNING.
    logging.basicConfig(level=logging.INFO, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        args = args_from_flags()
    except ValueError as e:  # a usage error before anything loads, naming the flags
        sys.exit(f"{e}\nSee --help for the flags.")
    multihost.initialize(args)  # before anything starts a JAX backend
    if args.node_rank > 0:  # a follower: no HTTP, it replays rank 0's steps
        sys.exit(multihost.run_follower(args))
    sys.exit(serve(args))


if __name__ == "__main__":
    app.run(main)
