"""Write shape:<name> (random weights, bf16) as an MLX model directory that mlx_lm.server
loads and tierchat loads too: one model for both servers in a side-by-side bench."""

import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import save_config, save_model

from tierchat.core.shapes import build_model, eos_token_ids, shape_config, tokenizer_dir

name, out = sys.argv[1], Path(sys.argv[2])
tok = tokenizer_dir(Path(os.environ["TIERCHAT_MODELS_DIR"]))
cfg = shape_config(name, eos_token_ids(tok))
model = build_model(cfg, mx.bfloat16)
out.mkdir(parents=True, exist_ok=True)
save_model(out, model)
for f in tok.iterdir():  # the tokenizer's files (not its config.json: the model's below)
    if f.is_file() and f.name != "config.json":
        shutil.copy(f, out / f.name)
save_config(dict(cfg), out / "config.json")
print("exported", name, "to", out, flush=True)
