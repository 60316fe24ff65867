"""Convert LLaVA-style JSON/JSONL conversations or an image folder with captions into ArrayRecord shards.

    python -m moevlm_jax.data.convert llava train.json --image-root images/ --out shards/ [--data-config CFG]
    python -m moevlm_jax.data.convert folder photos/ --out shards/ [--captions captions.jsonl] [--prompt "..."]

Each written record holds the conversation and the original bytes of its images and videos (see
``data.records``), never re-encoded: a video file (mp4, webm, mkv, avi, mov, ...) as the file it is, a video given
as a folder of frame images or a list of frame image paths as those frames' files, all of them in order (a folder's
in natural name order), so that the loader samples and decodes the same frames from the shards as from the JSON
file. Every entry is checked the way the loader would check it (conversation structure, image and video
placeholders vs images and videos, files present and decodable, aspect ratio; a video decoded and its frames
sampled with ``data.video``): entries that fail are skipped and counted by reason (``missing_image``,
``corrupt_video``, ...; audio: ``unsupported_media``). ``--data-config`` names the run's data config (a preset of
``configs/data/`` or a YAML file), whose ``data.image`` / ``data.video`` settings the check uses (default: their
defaults). A progress bar runs while converting; the summary (written, skipped by reason with an example each,
shards) is printed and saved as ``<out>/summary.json``. Sequence length and patch buckets are not checked here
(they depend on the training config): the loader counts ``too_long`` / ``too_many_patches``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moevlm_jax.data.chat import ConversationError, validate_messages
from moevlm_jax.data.config import DataError, ImageConfig, VideoConfig, load_data_config
from moevlm_jax.data.image import ImageSkip, decode_image
from moevlm_jax.data.records import RecordError, UnsupportedMedia, VideoBytes, VideoRef, encode_record, from_llava
from moevlm_jax.data.sample import SKIP_REASONS
from moevlm_jax.data.sources import ImageFolderSource, read_llava
from moevlm_jax.data.video import VideoSkip, decode_video, frame_files, frame_size

log = logging.getLogger(__name__)


def _read_bytes(path: Path, kind: str = "image") -> bytes:
    """A file's bytes; missing (or a directory) -> ``missing_<kind>``, unreadable -> ``corrupt_<kind>``."""
    skip = VideoSkip if kind == "video" else ImageSkip
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise skip(f"missing_{kind}", f"{path} not found") from None
    except IsADirectoryError:
        raise skip(f"missing_{kind}", f"{path} is a directory") from None
    except OSError as e:
        raise skip(f"corrupt_{kind}", f"cannot read {path}: {e}") from None


def _frames(files: list[Path], name: str, cfg: VideoConfig) -> list[bytes]:
    """The bytes of a video's frame images (every one, in order); as the loader: no frames, more than
    ``max_decode_frames`` or an unreadable frame -> ``corrupt_video``."""
    if not files:
        raise VideoSkip("corrupt_video", f"{name}: no frame images")
    if len(files) > cfg.max_decode_frames:
        raise VideoSkip("corrupt_video", f"{name}: {len(files)} frames > data.video.max_decode_frames "
                                         f"{cfg.max_decode_frames}")
    frames = []
    for f in files:
        try:
            frames.append(f.read_bytes())
        except OSError as e:
            raise VideoSkip("corrupt_video", f"cannot read frame {f} of {name}: {e}") from None
    return frames


def video_payload(ref: VideoRef, root: Path, video_cfg: VideoConfig, image_cfg: ImageConfig,
                  decode_check: bool = True) -> VideoBytes:
    """What a record stores of one video (``data.records``): a video file's bytes as they are, or a frame folder's /
    frame list's frame images (their files' bytes, in the order the loader reads them). With ``decode_check`` the
    stored form is decoded as the loader decodes it from a shard (frames sampled with ``video_cfg``) and its frame
    size checked. Raises :class:`VideoSkip` (``missing_video`` / ``corrupt_video`` / ``extreme_aspect``)."""
    def rooted(p: str) -> Path:
        return Path(p) if Path(p).is_absolute() else root / p

    payload: VideoBytes
    if isinstance(ref, list):
        payload = _frames([rooted(f) for f in ref], f"a list of {len(ref)} frames", video_cfg)
    else:
        path = rooted(ref)
        if path.is_dir():
            try:
                files = frame_files(path)
            except OSError as e:
                raise VideoSkip("corrupt_video", f"cannot list frame folder {path}: {e}") from None
            payload = _frames(files, f"frame folder {path}", video_cfg)
        else:
            payload = _read_bytes(path, "video")
            if not payload:
                raise VideoSkip("corrupt_video", f"video file {path} has zero bytes")
    if decode_check:
        try:
            clip = decode_video(payload, video_cfg, image_cfg)
        except VideoSkip as e:
            where = rooted(ref) if isinstance(ref, str) else f"frames {rooted(ref[0])} .. {rooted(ref[-1])}"
            raise VideoSkip(e.reason, f"{where}: {e}") from None
        frame_size(*clip.frames.shape[:3], video_cfg, image_cfg)
    return payload


def prepare_entry(entry: Any, image_root: Path, image_cfg: ImageConfig, decode_check: bool = True,
                  video_cfg: VideoConfig | None = None) -> tuple[bytes | None, str | None, str]:
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
        clips = [video_payload(v, image_root, video_cfg or VideoConfig(), image_cfg, decode_check) for v in videos]
        return encode_record(messages, images, meta, videos=clips), None, ""
    except (ImageSkip, ConversationError) as e:
        return None, e.reason, str(e)
    except UnsupportedMedia as e:
        return None, "unsupported_media", str(e)
    except (RecordError, KeyError, TypeError, AttributeError) as e:
        return None, "bad_record", f"{type(e).__name__}: {e}"


def convert(entries: list[Any], image_root: Path, out: Path, *, shard_size: int = 2000, prefix: str = "train",
            image_cfg: ImageConfig | None = None, video_cfg: VideoConfig | None = None, decode_check: bool = True,
            threads: int = 8, progress: Callable[[int, int, dict[str, int]], None] | None = None) -> dict[str, Any]:
    """Write ``entries`` as ArrayRecord shards under ``out``; returns the summary (also saved as summary.json)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    image_cfg = image_cfg or ImageConfig()
    video_cfg = video_cfg or VideoConfig()
    out.mkdir(parents=True, exist_ok=True)
    skipped: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    shards: list[str] = []
    written = 0
    writer = None

    def work(args: tuple[int, Any]) -> tuple[int, bytes | None, str | None, str]:
        index, entry = args
        return (index, *prepare_entry(entry, image_root, image_cfg, decode_check, video_cfg))

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
    p_llava = sub.add_parser("llava", help="LLaVA-style JSON list or JSONL conversations with image and video paths")
    p_llava.add_argument("input", type=Path)
    p_llava.add_argument("--image-root", type=Path, default=None, help="base of relative image and video paths")
    p_folder = sub.add_parser("folder", help="a folder of images with captions")
    p_folder.add_argument("input", type=Path)
    p_folder.add_argument("--captions", default=None, help="captions file (jsonl or json); default: look in the folder")
    p_folder.add_argument("--prompt", default=None, help="user prompt for every image")
    for p in (p_llava, p_folder):
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--prefix", default="train", help="shard file name prefix (train, heldout, ...)")
        p.add_argument("--shard-size", type=int, default=2000)
        p.add_argument("--threads", type=int, default=8)
        p.add_argument("--no-decode-check", action="store_true",
                       help="do not decode images and videos while converting")
        p.add_argument("--data-config", default=None,
                       help="the run's data config (preset name or YAML): its data.image / data.video settings check "
                            "the images and videos (default: their defaults)")
        p.add_argument("--max-aspect-ratio", type=float, default=None,
                       help="images: longer / shorter side above this is skipped (default: data.image's, 200)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.kind == "llava":
        entries = read_llava(args.input)
        root = args.image_root or args.input.parent
    else:
        entries = folder_entries(args.input, args.captions, args.prompt)
        root = args.input
    try:
        data_cfg = load_data_config(args.data_config) if args.data_config else None
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    image_cfg = data_cfg.image if data_cfg else ImageConfig()
    if args.max_aspect_ratio is not None:
        image_cfg = dataclasses.replace(image_cfg, max_aspect_ratio=args.max_aspect_ratio)
    video_cfg = data_cfg.video if data_cfg else VideoConfig()
    from tqdm import tqdm

    bar = tqdm(total=len(entries), unit="sample", desc="converting")

    def progress(written: int, skipped: int, reasons: dict[str, int]) -> None:
        bar.update(1)
        bar.set_postfix(written=written, skipped=skipped, refresh=False)

    try:
        summary = convert(entries, root, args.out, shard_size=args.shard_size, prefix=args.prefix,
                          image_cfg=image_cfg, video_cfg=video_cfg, decode_check=not args.no_decode_check,
                          threads=args.threads, progress=progress)
    except DataError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    bar.close()
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
