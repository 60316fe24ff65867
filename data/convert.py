"""Convert LLaVA-style JSON/JSONL conversations or an image folder with captions into ArrayRecord shards.

    python -m moevlm_jax.data.convert llava train.json --image-root images/ --out shards/
    python -m moevlm_jax.data.convert folder photos/ --out shards/ [--captions captions.jsonl] [--prompt "..."]

Each written record holds the conversation and the original image bytes (see ``data.records``).
Every entry is checked the way the loader would check it (conversation structure, image
placeholders vs images, image files present and decodable, aspect ratio); entries that fail are
skipped and counted by reason. A progress bar runs while converting; the summary (written, skipped
by reason with an example each, shards) is printed and saved as ``<out>/summary.json``. Sequence
length is not checked here (it depends on the training config): the loader counts ``too_long``.
Entries with video are counted as ``unsupported_media``: the records hold encoded images only (the loader trains
on a JSON file's videos directly).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moevlm_jax.data.chat import ConversationError, validate_messages
from moevlm_jax.data.config import DataError, ImageConfig
from moevlm_jax.data.image import ImageSkip, decode_image
from moevlm_jax.data.records import RecordError, UnsupportedMedia, encode_record, from_llava
from moevlm_jax.data.sample import SKIP_REASONS
from moevlm_jax.data.sources import ImageFolderSource, read_llava

log = logging.getLogger(__name__)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageSkip("missing_image", f"{path} not found") from None
    except IsADirectoryError:
        raise ImageSkip("missing_image", f"{path} is a directory") from None
    except OSError as e:
        raise ImageSkip("corrupt_image", f"cannot read {path}: {e}") from None


def prepare_entry(entry: Any, image_root: Path, image_cfg: ImageConfig, decode_check: bool = True
                  ) -> tuple[bytes | None, str | None, str]:
    """One LLaVA entry or folder record -> (encoded record, None, "") or (None, skip reason, detail)."""
    try:
        if entry is None:
            raise RecordError("unparsable JSON line")
        if isinstance(entry, dict) and "messages" in entry and "images" in entry and "meta" in entry:
            messages, paths, meta = entry["messages"], [i["path"] for i in entry["images"]], entry["meta"]
            videos = []
        else:
            messages, paths, videos, meta = from_llava(entry)
        kinds = validate_messages(messages)
        if kinds.count("video") != len(videos):
            raise ConversationError("video_count_mismatch",
                                    f"{kinds.count('video')} video placeholders but {len(videos)} videos")
        if videos:  # the record format holds encoded images only
            raise UnsupportedMedia("an entry with video cannot be written to ArrayRecord shards yet: train from "
                                   "the JSON file itself (--data FILE.json decodes its videos)")
        n = kinds.count("image")
        if n != len(paths):
            raise ConversationError("image_count_mismatch", f"{n} image placeholders but {len(paths)} images")
        images = []
        for p in paths:
            path = Path(p) if Path(p).is_absolute() else image_root / p
            data = _read_bytes(path)
            if decode_check:
                decode_image(data, image_cfg)
            elif not data:
                raise ImageSkip("empty_image", f"{path} has zero bytes")
            images.append(data)
        return encode_record(messages, images, meta), None, ""
    except (ImageSkip, ConversationError) as e:
        return None, e.reason, str(e)
    except UnsupportedMedia as e:
        return None, "unsupported_media", str(e)
    except (RecordError, KeyError, TypeError, AttributeError) as e:
        return None, "bad_record", f"{type(e).__name__}: {e}"


def convert(entries: list[Any], image_root: Path, out: Path, *, shard_size: int = 2000, prefix: str = "train",
            image_cfg: ImageConfig | None = None, decode_check: bool = True, threads: int = 8,
            progress: Callable[[int, int, dict[str, int]], None] | None = None) -> dict[str, Any]:
    """Write ``entries`` as ArrayRecord shards under ``out``; returns the summary (also saved as summary.json)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    image_cfg = image_cfg or ImageConfig()
    out.mkdir(parents=True, exist_ok=True)
    skipped: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    shards: list[str] = []
    written = 0
    writer = None

    def work(args: tuple[int, Any]) -> tuple[int, bytes | None, str | None, str]:
        index, entry = args
        return (index, *prepare_entry(entry, image_root, image_cfg, decode_check))

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for index, record, reason, detail in pool.map(work, enumerate(entries)):
            if record is None:
                skipped[reason] += 1
                examples.setdefault(reason, f"entry {index}: {detail}")
            else:
                if writer is None or written % shard_size == 0:
                    if writer is not None:
                        writer.close()
                    name = f"{prefix}-{len(shards):05d}.array_record"
                    writer = ArrayRecordWriter(str(out / name), "group_size:1")
                    shards.append(name)
                writer.write(record)
                written += 1
            if progress:
                progress(written, sum(skipped.values()), dict(skipped))
    if writer is not None:
        writer.close()
    summary = {"entries": len(entries), "written": written, "skipped": dict(skipped), "examples": examples,
               "shards": shards, "out": str(out)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if written == 0:
        raise DataError(f"nothing usable in {len(entries)} entries; skipped: {dict(skipped)}")
    return summary


def folder_entries(folder: Path, captions: str | None, prompt: str | None) -> list[Any]:
    """Records (messages + image paths) of an image folder with captions."""
    src = ImageFolderSource(folder, captions, *([prompt] if prompt else []))
    return [src[i] for i in range(len(src))]


def print_summary(summary: dict[str, Any], stream: Any = None) -> None:
    """The summary as a small table."""
    stream = stream or sys.stdout
    rows = [("entries", summary["entries"]), ("written", summary["written"])]
    rows += [(f"skipped: {r}", n) for r, n in sorted(summary["skipped"].items(), key=lambda x: -x[1])]
    width = max(len(r[0]) for r in rows)
    print(f"\nconverted into {len(summary['shards'])} shard(s) under {summary['out']}", file=stream)
    for name, n in rows:
        note = SKIP_REASONS.get(name.removeprefix("skipped: "), "") if name.startswith("skipped") else ""
        print(f"  {name:<{width}}  {n:>8}  {note}", file=stream)
    for reason, example in summary["examples"].items():
        print(f"  e.g. {reason}: {example}", file=stream)


def main(argv: Iterable[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(prog="python -m moevlm_jax.data.convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    p_llava = sub.add_parser("llava", help="LLaVA-style JSON list or JSONL conversations with image paths")
    p_llava.add_argument("input", type=Path)
    p_llava.add_argument("--image-root", type=Path, default=None, help="base of relative image paths")
    p_folder = sub.add_parser("folder", help="a folder of images with captions")
    p_folder.add_argument("input", type=Path)
    p_folder.add_argument("--captions", default=None, help="captions file (jsonl or json); default: look in the folder")
    p_folder.add_argument("--prompt", default=None, help="user prompt for every image")
    for p in (p_llava, p_folder):
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--prefix", default="train", help="shard file name prefix (train, heldout, ...)")
        p.add_argument("--shard-size", type=int, default=2000)
        p.add_argument("--threads", type=int, default=8)
        p.add_argument("--no-decode-check", action="store_true", help="do not decode images while converting")
        p.add_argument("--max-aspect-ratio", type=float, default=200.0)
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.kind == "llava":
        entries = read_llava(args.input)
        root = args.image_root or args.input.parent
    else:
        entries = folder_entries(args.input, args.captions, args.prompt)
        root = args.input
    from tqdm import tqdm

    bar = tqdm(total=len(entries), unit="sample", desc="converting")

    def progress(written: int, skipped: int, reasons: dict[str, int]) -> None:
        bar.update(1)
        bar.set_postfix(written=written, skipped=skipped, refresh=False)

    try:
        summary = convert(entries, root, args.out, shard_size=args.shard_size, prefix=args.prefix,
                          image_cfg=ImageConfig(max_aspect_ratio=args.max_aspect_ratio),
                          decode_check=not args.no_decode_check, threads=args.threads, progress=progress)
    except DataError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    bar.close()
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
