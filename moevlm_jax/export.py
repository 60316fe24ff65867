"""Export a training checkpoint as a Hugging Face model directory:
``python -m moevlm_jax.export --run-dir DIR [--step N] --out HF_DIR [--dtype float32|bfloat16]``.

The run's ``config.yaml`` gives the model; the checkpoint's ``params`` are restored onto one device
whatever layout (and however many processes) the run trained under — orbax stores the global arrays
— and written with ``moevlm_jax.hf.save_pretrained`` (safetensors shards + index + config.json, loadable
by ``transformers``). The same state saved under any layout exports to the same files, bit for bit.
A run fine-tuned from an HF checkpoint (``train.init_from``) exports with that checkpoint's side files beside the
weights (:data:`HF_SIDE_FILES`: the generation config, tokenizer, chat template and processor configs, as found
there), so the directory serves as the source did.
Without ``--step`` the newest checkpoint that restores is exported (a damaged newer one is skipped with
one log line, and left on disk); a ``--step`` that does not restore is an error.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from moevlm_jax.training.checkpoint import RestoreError

log = logging.getLogger("moevlm_jax.export")

# the files of an HF checkpoint directory, beside its weights and config.json, that its users expect to travel with
# it: generation defaults, the tokenizer and its chat template, the image / video processors
HF_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                 "special_tokens_map.json", "added_tokens.json", "chat_template.json", "chat_template.jinja",
                 "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")


def copy_side_files(run_dir: str | Path, out: str | Path) -> list[str]:
    """Copy :data:`HF_SIDE_FILES` present in the run's source checkpoint (``train.init_from`` of its config.yaml)
    to ``out``; returns the names copied. A source that is gone is said in one warning (the weights are exported
    without them)."""
    from moevlm_jax.schema import read_yaml

    source = ((read_yaml(Path(run_dir) / "config.yaml") or {}).get("train") or {}).get("init_from")
    if not source:
        return []
    source = Path(source).expanduser()
    if not source.is_dir():
        log.warning("the run's source checkpoint %s is gone: its generation config, tokenizer and processor files "
                    "are not copied to %s", source, out)
        return []
    copied = [name for name in HF_SIDE_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, Path(out) / name)
    return copied


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str | None = None,
               max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write checkpoint ``step`` (default: the newest that restores) of the run in ``run_dir`` to ``out`` as an
    HF directory; ``dtype`` casts the parameters (default: as saved). Returns ``out``."""
    from moevlm_jax.hf import save_pretrained
    from moevlm_jax.inference.loading import restore_run
    from moevlm_jax.model.registry import build_model

    model_cfg, compute, _, step, params = restore_run(run_dir, step)
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                              params)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(model_cfg, compute, nnx.Rngs(0))))
    save_pretrained(nnx.merge(graphdef, params), model_cfg, out, max_shard_bytes=max_shard_bytes)
    copied = copy_side_files(run_dir, out)
    if copied:
        log.info("copied %s from the run's source checkpoint", ", ".join(copied))
    log.info("exported %s step %d to %s", run_dir, step, out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    """CLI: export a run's checkpoint; 2 on a missing run / checkpoint, 1 when none (or not the one asked
    for) restores."""
    p = argparse.ArgumentParser(prog="python -m moevlm_jax.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="a training run directory (config.yaml + checkpoints/)")
    p.add_argument("--step", type=int, default=None,
                   help="exactly this checkpoint step (default: the newest that restores)")
    p.add_argument("--out", required=True, help="the Hugging Face directory to write")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="cast the weights (default: as saved)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        out = export_run(args.run_dir, args.out, step=args.step, dtype=args.dtype,
                         max_shard_bytes=int(args.max_shard_gb * 2**30))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RestoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {args.run_dir} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
