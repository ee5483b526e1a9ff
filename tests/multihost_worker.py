"""One process of a multi-process engine test (tests/test_multihost.py starts two).

    python tests/multihost_worker.py SPEC.json

SPEC: {"args": ServerArgs fields, "prompts": [[ids]], "max_new_tokens": n, "out": path}.
Rank 0 runs the offline Engine and writes each prompt's greedy tokens and top logprobs to
`out` as JSON; the other ranks replay its steps (multihost.run_follower). The exit code
is the process's verdict.
"""

from __future__ import annotations

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime import multihost  # noqa: E402
from runtime.config import ServerArgs  # noqa: E402


def engine_outputs(args: ServerArgs, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy tokens and top logprobs of each prompt through an Engine built from args."""
    from runtime.engine import Engine
    from runtime.request import SamplingParams

    engine = Engine(args)
    try:
        outs = engine.generate(prompts, SamplingParams(
            temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True, top_logprobs=2))
        engine.runner.check_no_compiles()
    finally:
        engine.close()
    return {"tokens": [o.output_ids for o in outs],
            "top_logprobs": [o.meta_info["output_top_logprobs"] for o in outs],
            "processes": __import__("jax").process_count()}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK')}"
                        " %(levelname)s %(name)s: %(message)s")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    args = ServerArgs(**{k: tuple(v) if isinstance(v, list) else v
                         for k, v in spec["args"].items()})
    multihost.initialize(args)
    if args.node_rank > 0:
        return multihost.run_follower(args)
    result = engine_outputs(args, spec["prompts"], spec["max_new_tokens"])
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
