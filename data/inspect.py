"""Print a summary of a few batches of a data config (shapes, fill, skips, decoded text), optionally dump images.

    python -m moevlm_jax.data.inspect                       # default vqa preset
    python -m moevlm_jax.data.inspect proxy --batches 2 --dump /tmp/imgs
    python -m moevlm_jax.data.inspect vqa --split heldout --set seq_len=512
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable
from pathlib import Path

import numpy as np


def _image_from_patches(pixel_values: np.ndarray, rc: np.ndarray, hw: tuple[int, int], mean: np.ndarray,
                        std: np.ndarray, patch: int = 16) -> np.ndarray:
    """Rebuild uint8 [H, W, 3] (first frame) from one image's rows of pixel_values [N, 1536]."""
    h, w = hw
    canvas = np.zeros((h * patch, w * patch, 3), np.float32)
    x = pixel_values.reshape(-1, 3, 2, patch, patch)[:, :, 0]  # (N, C, p, p), frame 0
    for (r, c), p in zip(rc, x):
        canvas[r * patch:(r + 1) * patch, c * patch:(c + 1) * patch] = p.transpose(1, 2, 0)
    return np.clip((canvas * std + mean) * 255 + 0.5, 0, 255).astype(np.uint8)


def main(argv: Iterable[str] | None = None) -> int:
    """CLI entry point."""
    from moevlm_jax.data.loader import build_loader, throughput_line
    from moevlm_jax.data.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m moevlm_jax.data.inspect", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default="vqa")
    parser.add_argument("--split", default="train")
    parser.add_argument("--batches", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1, help="rows whose text is printed")
    parser.add_argument("--chars", type=int, default=600, help="characters of text printed per row")
    parser.add_argument("--dump", type=Path, default=None, help="write the batch's images here as PNG")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import time

    start = time.perf_counter()
    loader = build_loader(args.config, split=args.split, overrides=args.set)
    tok = load_tokenizer(loader.config.tokenizer)
    print(f"{loader.label} | split {args.split} | {loader.source_len} samples | eval={loader.eval_mode}")
    for n, batch in zip(range(args.batches), loader):
        print(f"\nbatch {n}:")
        for key, value in batch.items():
            if hasattr(value, "shape"):
                print(f"  {key:18s} {value.dtype!s:8s} {list(value.shape)}")
        stats = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in batch["stats"].items()}
        print(f"  stats {stats}")
        for r in range(min(args.rows, batch["input_ids"].shape[0])):
            seg = batch["segment_ids"][r]
            ids = batch["input_ids"][r][seg > 0]
            text = tok.decode(ids)
            text = text.replace("<|image_pad|>" * 4, "#").replace("#" * 8, "#")
            print(f"  row {r}: {int((seg > 0).sum())} tokens, {len(np.unique(seg[seg > 0]))} samples; text "
                  f"(runs of image pads shortened to #):\n    {text[: args.chars]!r}")
            trained = batch["targets"][r][batch["loss_mask"][r] > 0]
            print(f"    trained targets: {tok.decode(trained)[: args.chars]!r}")
        if args.dump is not None and "pixel_values" in batch:
            from PIL import Image

            args.dump.mkdir(parents=True, exist_ok=True)
            img = loader.config.image
            mean, std = np.asarray(img.image_mean, np.float32), np.asarray(img.image_std, np.float32)
            for r in range(batch["pixel_values"].shape[0]):
                segs = batch["patch_segment_ids"][r]
                for s in np.unique(segs[segs > 0]):
                    sel = segs == s
                    hw = tuple(int(v) for v in batch["patch_hw"][r][sel][0])
                    arr = _image_from_patches(batch["pixel_values"][r][sel], batch["patch_rc"][r][sel], hw, mean, std,
                                              img.patch_size)
                    Image.fromarray(arr).save(args.dump / f"batch{n}_row{r}_image{s}.png")
            print(f"  images written to {args.dump}")
    print("\n" + throughput_line(loader.summary(), time.perf_counter() - start) + " (includes start-up)")
    loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
