"""Generate answers: ``python -m moevlm_jax.generate (--run-dir DIR [--step N] | --hf HF_DIR)
--image PATH... --video PATH... --prompt TEXT [--max-new-tokens N] [--temperature T --top-p P] [--seed S]``, or a
batch of questions: ``--questions FILE.jsonl [--out OUT.jsonl]`` (each line ``{"images": [paths],
"videos": [paths], "prompt": "...", "answer": optional}``; one JSON line per question out: prompt, images, videos,
answer, generated, token_ids, match). Media go at the prompt's ``<image>`` / ``<video>`` placeholders when it has
them for each, in that order, else first: the images, then the videos, then the text.

The chat template, tokenizer and image / video processing are the training data's (``data.chat``,
``data.tokenizer``, ``data.image``, ``data.video``: a video is a file FFmpeg reads or a folder of frame images,
its frames sampled at ``data.video.fps`` up to ``max_frames``, with timestamps; for a run, its ``config.yaml``
data section; for an HF directory, its ``tokenizer.json``, ``preprocessor_config.json`` and
``video_preprocessor_config.json`` when present, else the offline Qwen3 tokenizer and Qwen3-VL's defaults).
Generation: ``moevlm_jax.inference`` (KV cache, greedy unless ``--temperature`` > 0, stops at ``<|im_end|>`` /
``<|endoftext|>``). A run of any layout is restored onto one device (its parameters only).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("moevlm_jax.generate")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moevlm_jax.generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", help="a training run directory (config.yaml + checkpoints/)")
    src.add_argument("--hf", help="a Hugging Face model directory")
    p.add_argument("--step", type=int, help="checkpoint step of --run-dir (default: the newest that restores)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="the question (images go first, or at its <image> placeholders)")
    what.add_argument("--questions",
                      help="JSONL: {\"images\": [...], \"prompt\": \"...\", \"answer\": optional} a line")
    p.add_argument("--image", nargs="*", default=[], help="image files of --prompt")
    p.add_argument("--video", nargs="*", default=[], help="videos of --prompt: files (mp4, webm, ...) or frame folders")
    p.add_argument("--out", help="--questions: write the JSON lines here (default: stdout)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="--questions per generation batch")
    p.add_argument("--system-prompt", help="a system turn (default: the run's data.system_prompt, else none)")
    p.add_argument("--dtype", help="compute dtype (default: the run's; for --hf bfloat16 on GPU, float32 else)")
    p.add_argument("--tokenizer", help="'qwen3' or a tokenizer.json (default: the run's / the HF dir's)")
    p.add_argument("--min-pixels", type=int, help="override image min_pixels")
    p.add_argument("--max-pixels", type=int, help="override image max_pixels")
    p.add_argument("--max-frames", type=int, help="override video max_frames (a longer clip is sampled down to it)")
    p.add_argument("--quiet", action="store_true", help="warnings only")
    return p.parse_args(argv)


def read_questions(path: str | Path) -> list[dict[str, Any]]:
    """The questions file: one JSON object a line (blank lines skipped); image and video paths relative to the
    file."""
    path = Path(path)
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row:
            raise ValueError(f"{path}:{n}: no 'prompt'")
        for key in ("images", "videos"):
            refs = row.get(key) or []
            refs = [refs] if isinstance(refs, str) else list(refs)
            row[key] = [str(p if Path(p).is_absolute() else path.parent / p) for p in refs]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry; 2 on bad arguments or inputs, 1 when the run's checkpoint does not restore."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from moevlm_jax import inference
    from moevlm_jax.training.checkpoint import RestoreError

    t0 = time.perf_counter()
    try:
        loaded = (inference.load_run(args.run_dir, args.step, dtype=args.dtype, tokenizer=args.tokenizer)
                  if args.run_dir else inference.load_hf(args.hf, dtype=args.dtype, tokenizer=args.tokenizer))
        questions = (read_questions(args.questions) if args.questions
                     else [{"prompt": args.prompt, "images": list(args.image), "videos": list(args.video)}])
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RestoreError as e:  # no checkpoint of the run restores (or not the --step asked for)
        print(f"error: {e}", file=sys.stderr)
        return 1
    image_cfg = loaded.image_config
    pixels = {k: v for k, v in (("min_pixels", args.min_pixels), ("max_pixels", args.max_pixels)) if v is not None}
    if pixels:
        image_cfg = dataclasses.replace(image_cfg, **pixels)
    video_cfg = loaded.video_config
    if args.max_frames is not None:
        video_cfg = dataclasses.replace(video_cfg, max_frames=args.max_frames)
    system = args.system_prompt if args.system_prompt is not None else loaded.system_prompt
    log.info("model from %s%s loaded in %.1fs", loaded.source, f" (step {loaded.step})" if loaded.step else "",
             time.perf_counter() - t0)
    t0 = time.perf_counter()
    from moevlm_jax.data.chat import ConversationError
    from moevlm_jax.data.image import ImageSkip

    media = [[*q["images"], *(inference.Video(v) for v in q["videos"])] for q in questions]
    try:
        results = inference.generate(loaded.model, loaded.tokenizer, [q["prompt"] for q in questions], media,
                                     image_config=image_cfg, system_prompt=system, video_config=video_cfg,
                                     max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     top_p=args.top_p, seed=args.seed, batch_size=args.batch_size, return_ids=True)
    except (FileNotFoundError, ImageSkip, ConversationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("%d answer(s) in %.1fs (compiles: %s)", len(results), time.perf_counter() - t0, inference.TRACES)
    if not args.questions:
        print(results[0][0])
        return 0
    with open(args.out, "w") if args.out else contextlib.nullcontext(sys.stdout) as out:
        for q, (text, ids) in zip(questions, results):
            row = {"prompt": q["prompt"], "images": q["images"], "videos": q["videos"], "answer": q.get("answer"),
                   "generated": text,
                   "token_ids": [int(i) for i in ids]}
            if q.get("answer") is not None:
                row["match"] = text.strip().casefold() == str(q["answer"]).strip().casefold()
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
