"""Convert a GGUF file or a Hugging Face safetensors folder into an orbax checkpoint.

  .venv/bin/python scripts/convert_checkpoint.py --input=model.gguf --output=/abs/dir \
      --dtype=bfloat16

The output directory holds `state/` (orbax), `model_config.json` and
`checkpoint_meta.json`; load it with `runtime.checkpoint.restore_checkpoint`.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import checkpoint  # noqa: E402

INPUT = flags.DEFINE_string("input", None, "GGUF file or Hugging Face folder", required=True)
OUTPUT = flags.DEFINE_string("output", None, "orbax checkpoint directory", required=True)
DTYPE = flags.DEFINE_enum("dtype", "float32", sorted(checkpoint.DTYPES), "stored dtype")


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
    t0 = time.perf_counter()
    try:
        cfg = checkpoint.convert(INPUT.value, os.path.abspath(OUTPUT.value), DTYPE.value)
    except checkpoint.CheckpointError as e:
        sys.exit(f"error: {e}")
    print(f"converted {cfg.architecture} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}) in {time.perf_counter() - t0:.2f}s")


if __name__ == "__main__":
    app.run(main)
