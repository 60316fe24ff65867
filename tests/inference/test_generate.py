"""Generation (moevlm_jax.inference, python -m moevlm_jax.generate) against HF transformers on tiny
random models (tests/model/hf_reference.py), float32 on CPU:

- greedy ids equal HF ``generate(do_sample=False)``: text only, one image, two images of different
  sizes, an image and a video (two frame pairs, each after its timestamp), a batch of two prompts (left
  padding; an image prompt next to a text prompt, on a config with dense and MoE stacks and tied
  embeddings), and stopping at a stop id as HF's eos;
- the KV-cache decode equals no-cache greedy decoding (the full forward recomputed each step):
  same ids, logits within 1e-5 relative; and HF's per-step logits within 1e-4 relative;
- compiles: one prefill and one decode program serve prompts of other lengths in the same bucket;
- sampling (temperature + top-p) is reproducible under a seed, and top_p -> 0 is greedy;
- the CLI on a saved HF dir (real Qwen3 vocabulary, a JPEG) prints text and its ids equal HF's; with
  ``--video`` (an mp4 PyAV wrote, sampled by the dir's video_preprocessor_config.json) likewise; the end-of-run
  answers hook on a LLaVA JSON of video entries generates HF's ids from the training sample's own prompt;
  on a training run dir (FSDP over 8 devices) it restores only the params onto one device.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch

from moevlm_jax import inference
from moevlm_jax.data.mrope import mrope_position_ids
from moevlm_jax.hf import load_pretrained
from moevlm_jax.inference import Prompt, generate_ids
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.qwen3_vl_moe import jit_forward
from tests.model.hf_reference import IMAGE, V_END, V_START, VIDEO, build_hf

COMPUTE = ComputeConfig(dtype="float32", param_dtype="float32", scan_layers=False)  # unrolled: faster CPU compiles
N = 8  # new tokens
# every prompt here: S = 64, T = 128, P = 64 (text-only prompts too: one prefill program per config)
BUCKETS = dict(prompt_bucket=64, cache_bucket=64, num_patches=64)


def make_prompt(seed: int, n_text: int, grids: list[tuple[int, int, int]], patch_dim: int = 1536) -> Prompt:
    """Random text ids with each image as <vision_start> image tokens <vision_end> after the first token."""
    rng = np.random.default_rng(seed)
    ids = list(rng.integers(0, 400, n_text))
    at = 1
    for t, h, w in grids:
        run = [V_START] + [IMAGE] * (t * h * w // 4) + [V_END]
        ids[at:at] = run
        at += len(run) + 2  # two text tokens between images
    if not grids:
        return Prompt(np.asarray(ids, np.int32))
    n = sum(t * h * w for t, h, w in grids)
    return Prompt(np.asarray(ids, np.int32), rng.standard_normal((n, patch_dim)).astype(np.float32),
                  np.asarray(grids, np.int64))


def make_video_prompt(seed: int, n_text: int, image: tuple[int, int, int], video: tuple[int, int, int],
                      patch_dim: int = 1536) -> Prompt:
    """An image, two text tokens, then a video: per frame pair a text token (its timestamp) and the pair's
    <vision_start> video tokens <vision_end>, then the rest of the text."""
    prompt = make_prompt(seed, n_text, [image])
    rng = np.random.default_rng(seed + 100)
    t, h, w = video
    ids = list(prompt.input_ids)
    at = 1 + h * w // 4 + 2 + 2
    for _ in range(t):
        run = [int(rng.integers(0, 400)), V_START] + [VIDEO] * (h * w // 4) + [V_END]
        ids[at:at] = run
        at += len(run)
    return Prompt(np.asarray(ids, np.int32), prompt.pixel_values, prompt.image_grid_thw,
                  rng.standard_normal((t * h * w, patch_dim)).astype(np.float32), np.asarray([video], np.int64))


PROMPTS = {
    "text": [make_prompt(0, 11, [])],
    "one_image": [make_prompt(1, 9, [(1, 4, 6)])],
    "two_images": [make_prompt(2, 10, [(1, 4, 4), (1, 6, 4)])],
    "batch2": [make_prompt(3, 8, [(1, 6, 4)]), make_prompt(4, 17, [])],
    "image_video": [make_video_prompt(5, 9, (1, 4, 4), (2, 4, 4))],  # 16 + 32 patches: the same P = 64
}
CASES = [("tiny", "text"), ("tiny", "one_image"), ("tiny", "two_images"), ("tiny", "image_video"),
         ("dense_mix", "batch2")]


def hf_generate(model, prompts: list[Prompt], n: int = N, image_token: int = IMAGE, video_token: int = VIDEO, **kw):
    """HF generate on left-padded prompts -> (new ids [B, steps], output) (pad id 0, no eos unless given)."""
    s = max(len(p.input_ids) for p in prompts)
    ids = np.zeros((len(prompts), s), np.int64)
    mask = np.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, s - len(p.input_ids):] = p.input_ids
        mask[r, s - len(p.input_ids):] = 1
    args = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    imgs = [p for p in prompts if p.pixel_values is not None]
    vids = [p for p in prompts if p.pixel_values_videos is not None]
    if imgs:
        args.update(pixel_values=torch.tensor(np.concatenate([p.pixel_values for p in imgs])),
                    image_grid_thw=torch.tensor(np.concatenate([p.image_grid_thw for p in imgs])))
    if vids:
        args.update(pixel_values_videos=torch.tensor(np.concatenate([p.pixel_values_videos for p in vids])),
                    video_grid_thw=torch.tensor(np.concatenate([p.video_grid_thw for p in vids])))
    if imgs or vids:  # text 0, image 1, video 2
        args["mm_token_type_ids"] = torch.tensor((ids == image_token) + 2 * (ids == video_token)).long()
    kw = {"pad_token_id": 0, "eos_token_id": None, **kw}
    with torch.no_grad():
        out = model.generate(**args, do_sample=False, max_new_tokens=n, return_dict_in_generate=True, **kw)
    return out.sequences[:, s:].numpy(), out


@pytest.fixture(scope="module")
def ours(hf_models):
    return {name: load_pretrained(hf_models[name].path, compute=COMPUTE)[0] for name in ("tiny", "dense_mix")}


@pytest.mark.parametrize("config_name,case", CASES)
def test_greedy_matches_hf(hf_models, ours, config_name, case):
    prompts = PROMPTS[case]
    # keep_logits on the batch of 2: the decode program of the cache test below (one compile fewer)
    got = generate_ids(ours[config_name], prompts, max_new_tokens=N, pad_id=0, keep_logits=case == "batch2",
                       **BUCKETS)
    want, _ = hf_generate(hf_models[config_name].model, prompts)
    assert [g.tolist() for g in got.tokens] == want.tolist()
    assert (got.prompt_len, got.cache_len) == (64, 128)


def test_stop_id_as_hf_eos(hf_models, ours):
    """A row stops at its first stop id (included), stopped rows are padded, as HF's eos handling."""
    prompts = PROMPTS["batch2"]
    free, _ = hf_generate(hf_models["dense_mix"].model, prompts)
    stop = int(free[0, 3])  # row 0 stops at step 3 (or before, if the id came earlier); row 1 maybe never
    want, _ = hf_generate(hf_models["dense_mix"].model, prompts, eos_token_id=stop, pad_token_id=7)
    got = generate_ids(ours["dense_mix"], prompts, max_new_tokens=N, stop_ids=[stop], pad_id=7, keep_logits=True,
                       **BUCKETS)
    for r in range(2):
        row = want[r].tolist()
        row = row[: row.index(stop) + 1] if stop in row else row
        assert got.tokens[r].tolist() == row
        assert bool(got.stopped[r]) == (stop in row)
    assert got.stopped[0]


def no_cache_greedy(model, prompts: list[Prompt], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding without a cache: each step the whole forward over [prompt + generated so far]
    (fixed length S + n, the tail padding), positions recomputed with data.mrope -> ids, logits."""
    s = max(len(p.input_ids) for p in prompts)
    b, total = len(prompts), s + n
    ids = np.zeros((b, total), np.int32)
    mask = np.zeros((b, total), np.int32)
    for r, p in enumerate(prompts):
        ids[r, s - len(p.input_ids): s] = p.input_ids
        mask[r, s - len(p.input_ids): s] = 1
    batch, _ = inference.prompt_batch(model.config, prompts, pad_id=0, prompt_bucket=s, num_patches=64)
    out, logits = [], []
    for k in range(n):
        positions = np.zeros((3, b, total), np.int32)
        for r, p in enumerate(prompts):
            valid = mask[r] > 0
            pos, _ = mrope_position_ids(ids[r, valid], p.image_grid_thw, image_token_id=IMAGE)
            positions[:, r, valid] = pos
        step = {**batch, "input_ids": ids, "segment_ids": mask, "positions": positions}
        lg = np.asarray(jit_forward(model, step)[0])[:, s + k - 1]
        tok = lg.argmax(-1)
        ids[:, s + k], mask[:, s + k] = tok, 1
        out.append(tok)
        logits.append(lg)
    return np.stack(out, 1), np.stack(logits, 1)


def test_cache_equals_no_cache_and_hf_logits(hf_models, ours):
    model = ours["dense_mix"]
    prompts = PROMPTS["batch2"]
    s = max(len(p.input_ids) for p in prompts)
    got = generate_ids(model, prompts, max_new_tokens=N, pad_id=0, keep_logits=True, **BUCKETS)
    ref_ids, ref_logits = no_cache_greedy(model, prompts, N)
    assert np.stack(got.tokens).tolist() == ref_ids.tolist()
    scale = np.abs(ref_logits).max()
    assert np.abs(got.logits - ref_logits).max() <= 1e-5 * scale
    _, hf = hf_generate(hf_models["dense_mix"].model, prompts, output_logits=True)
    hf_logits = torch.stack(hf.logits, 1).numpy()
    assert np.abs(got.logits - hf_logits).max() <= 1e-4 * scale
    assert s < got.prompt_len  # the cache path ran on padded prompts (S = 64): padding changes nothing


def test_compiles_once_per_bucket(hf_models, ours):
    """Other prompt lengths, images, max_new_tokens and stop ids in the same buckets, and the same
    model loaded again: no new compile (prefill and decode traced once each)."""
    model = ours["tiny"]
    generate_ids(model, PROMPTS["text"], max_new_tokens=N, pad_id=0, **BUCKETS)
    before = dict(inference.TRACES)
    reloaded = load_pretrained(hf_models["tiny"].path, compute=COMPUTE)[0]
    for m, n_text, grids, new in ((model, 5, [], 3), (model, 30, [(1, 8, 4)], 20), (reloaded, 20, [(1, 2, 2)], 8)):
        out = generate_ids(m, [make_prompt(9, n_text, grids)], max_new_tokens=new, pad_id=0, stop_ids=[1, 2],
                           **BUCKETS)
        assert (out.prompt_len, out.cache_len) == (64, 128)
        assert all(len(t) <= new for t in out.tokens)
    assert inference.TRACES == before


def test_sampling_reproducible_and_top_p_tiny_is_greedy(ours):
    model = ours["tiny"]
    prompts = PROMPTS["text"]
    kw = dict(max_new_tokens=N, pad_id=0, **BUCKETS)
    greedy = generate_ids(model, prompts, **kw).tokens[0]
    a = generate_ids(model, prompts, temperature=1.5, top_p=0.95, seed=1, **kw).tokens[0]
    b = generate_ids(model, prompts, temperature=1.5, top_p=0.95, seed=1, **kw).tokens[0]
    others = [generate_ids(model, prompts, temperature=1.5, top_p=0.95, seed=k, **kw).tokens[0] for k in (2, 3)]
    assert a.tolist() == b.tolist()
    assert any(o.tolist() != a.tolist() for o in others)  # the seed matters
    assert a.tolist() != greedy.tolist()
    tiny_p = generate_ids(model, prompts, temperature=1.5, top_p=1e-6, seed=4, **kw).tokens[0]
    assert tiny_p.tolist() == greedy.tolist()


def test_top_p_mask():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    keep = lambda p: np.asarray(inference.top_p_mask(logits, p))[0].tolist()
    assert keep(0.4) == [True, False, False, False]
    assert keep(0.8) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1.0) == [True, True, True, True]


# ----------------------------------------------------------------------------- the CLI


def _write_jpeg(path, size=(96, 56), seed=0) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=90)


def _run_cli(argv: list[str]) -> str:
    from moevlm_jax.generate import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


@pytest.fixture(scope="module")
def qwen_vocab_hf(tmp_path_factory):
    """configs/models/tiny.yaml (the real Qwen3 vocabulary and special ids) as a random HF model, saved."""
    from moevlm_jax.model.registry import load_model_config

    hf = build_hf(load_model_config("tiny").to_hf_dict(), seed=5)
    path = tmp_path_factory.mktemp("hf_tiny_qwen_vocab")
    hf.save_pretrained(path)
    # HF's Qwen3-VL video processor keys, a small pixel budget: 4 frames of 48 x 64 -> 64 x 64, grid (2, 4, 4)
    (path / "video_preprocessor_config.json").write_text(json.dumps(
        {"fps": 2, "min_frames": 4, "max_frames": 16, "size": {"shortest_edge": 4096, "longest_edge": 16384}}))
    return hf, path


def test_cli_hf_dir_matches_hf(qwen_vocab_hf, tmp_path):
    hf, path = qwen_vocab_hf
    jpeg = tmp_path / "photo.jpg"
    _write_jpeg(jpeg)
    pixels = ["--min-pixels", "4096", "--max-pixels", "16384"]  # the 96 x 56 photo -> 96 x 64 px: 6 x 4 patches
    text = _run_cli(["--hf", str(path), "--image", str(jpeg), "--prompt", "What is in the picture?",
                     "--max-new-tokens", "6", "--quiet", *pixels])
    assert text.strip()

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"images": ["photo.jpg"], "prompt": "What is in the picture?", "answer": "a cat"})
                         + "\n" + json.dumps({"images": [], "prompt": "Say hi."}) + "\n")
    out = tmp_path / "answers.jsonl"
    _run_cli(["--hf", str(path), "--questions", str(questions), "--out", str(out), "--max-new-tokens", "6",
              "--batch-size", "1", "--quiet", *pixels])  # batch 1: the image question reuses --prompt's programs
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["a cat", None] and rows[0]["match"] is False
    assert rows[0]["generated"] == text.rstrip("\n")

    # the same prompts (training template + tokenizer + image processing) through HF generate
    from moevlm_jax.data.config import ImageConfig
    from moevlm_jax.data.tokenizer import load_tokenizer

    tok = load_tokenizer("qwen3")
    cfg = ImageConfig(min_pixels=4096, max_pixels=16384)
    prompts = [inference.chat_prompt(tok, "What is in the picture?", [str(jpeg)], cfg),
               inference.chat_prompt(tok, "Say hi.", [], cfg)]
    assert prompts[0].input_ids[-3:].tolist() == [tok.special_id("<|im_start|>"), *tok.encode("assistant\n")]
    assert prompts[0].image_grid_thw.tolist() == [[1, 4, 6]]
    assert int((prompts[0].input_ids == tok.special_id("<|image_pad|>")).sum()) == 6
    for prompt, row in zip(prompts, rows):
        want, _ = hf_generate(hf, [prompt], n=6, image_token=tok.special_id("<|image_pad|>"),
                              eos_token_id=list(inference.stop_ids_of(tok)), pad_token_id=tok.pad_id)
        ids = want[0].tolist()
        stops = [i for i, t in enumerate(ids) if t in inference.stop_ids_of(tok)]
        assert row["token_ids"] == (ids[: stops[0] + 1] if stops else ids)


def _hf_ids(hf, prompt: Prompt, tok, n: int) -> list[int]:
    """HF greedy ids of a chat prompt, cut after the first stop id (as the CLI's ``token_ids``)."""
    stops = inference.stop_ids_of(tok)
    want, _ = hf_generate(hf, [prompt], n=n, image_token=tok.special_id("<|image_pad|>"),
                          video_token=tok.special_id("<|video_pad|>"), eos_token_id=list(stops),
                          pad_token_id=tok.pad_id)
    ids = want[0].tolist()
    ends = [i for i, t in enumerate(ids) if t in stops]
    return ids[: ends[0] + 1] if ends else ids


def test_cli_video_matches_hf(qwen_vocab_hf, tmp_path):
    """``--video`` (an mp4 PyAV wrote): frames sampled and sized by the HF dir's video_preprocessor_config.json, the
    prompt's timestamped frame-pair groups, and the ids HF generates from that prompt."""
    from moevlm_jax.data.tokenizer import load_tokenizer
    from moevlm_jax.inference.loading import video_config_from_hf
    from tests.data.video_files import moving_square, write_mp4

    hf, path = qwen_vocab_hf
    write_mp4(tmp_path / "clip.mp4", moving_square(4, 48, 64), fps=2)  # 2 s: 4 frames sampled at fps 2
    question = "Which way did the square move?"
    (tmp_path / "q.jsonl").write_text(json.dumps({"videos": ["clip.mp4"], "prompt": question, "answer": "right"}))
    out = tmp_path / "answers.jsonl"
    _run_cli(["--hf", str(path), "--questions", str(tmp_path / "q.jsonl"), "--out", str(out), "--max-new-tokens",
              "6", "--quiet"])
    row = json.loads(out.read_text())
    assert row["videos"] == [str(tmp_path / "clip.mp4")] and row["match"] is False
    text = _run_cli(["--hf", str(path), "--video", str(tmp_path / "clip.mp4"), "--prompt", question,
                     "--max-new-tokens", "6", "--quiet"])
    assert text[:-1] == row["generated"]  # print adds one newline

    tok = load_tokenizer("qwen3")
    video_cfg = video_config_from_hf(path)
    assert (video_cfg.fps, video_cfg.min_pixels, video_cfg.max_pixels) == (2, 4096, 16384)
    prompt = inference.chat_prompt(tok, question, [inference.Video(str(tmp_path / "clip.mp4"))],
                                   video_config=video_cfg)
    assert prompt.video_grid_thw.tolist() == [[2, 4, 4]] and prompt.pixel_values_videos.shape == (32, 1536)
    assert int((prompt.input_ids == tok.special_id("<|video_pad|>")).sum()) == 8
    # frame pairs (0, 1) and (2, 3) at 2 fps: 0.25 s and 1.25 s, written as HF's processor does
    assert "<0.2 seconds><|vision_start|>" in tok.decode(prompt.input_ids.tolist())
    assert "<1.2 seconds><|vision_start|>" in tok.decode(prompt.input_ids.tolist())
    assert row["token_ids"] == _hf_ids(hf, prompt, tok, 6)


def test_answers_hook_on_video_records(qwen_vocab_hf, tmp_path):
    """The end-of-run answers on a LLaVA JSON of video entries: each held-out question generates HF's ids from the
    training sample's own prompt (the pipeline's tokens up to the answer, its decoded frames)."""
    import jax
    from flax import nnx

    from moevlm_jax.config import load_config
    from moevlm_jax.data.image import expand_patches
    from moevlm_jax.data.sample import SampleProcessor, read_record
    from moevlm_jax.data.sources import build_source
    from moevlm_jax.data.tokenizer import load_tokenizer
    from moevlm_jax.training.hooks import answers
    from tests.data.video_files import moving_square, write_mp4

    hf, path = qwen_vocab_hf
    entries = []
    for k in range(4):
        write_mp4(tmp_path / f"clip{k}.mp4", moving_square(4 + 2 * k, 48, 64, seed=k), fps=2)
        entries.append({"video": f"clip{k}.mp4", "conversations": [
            {"from": "human", "value": "<video>\nWhich way did the square move?"}, {"from": "gpt", "value": "right"}]})
    (tmp_path / "clips.json").write_text(json.dumps(entries))
    cfg = load_config("cpu-default", model=str(path), data=str(tmp_path / "clips.json"), num_devices=1,
                      num_processes=1, overrides=["data.heldout_fraction=0.5", "data.video.min_pixels=4096",
                                                  "data.video.max_pixels=16384", "data.workers=0"])
    model = load_pretrained(path, compute=COMPUTE)[0]
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    rows = answers(cfg, {"params": params}, 2)
    assert [r["answer"] for r in rows] == ["right", "right"]

    tok = load_tokenizer(cfg.data.tokenizer)
    source, _ = build_source(cfg.data, cfg.data.eval_split)
    process = SampleProcessor(cfg.data, eval_mode=True)
    for i, row in enumerate(rows):
        assert read_record(source[i])["videos"]
        sample = process(i, source[i])
        assert sample["videos"] == 1
        end = int(np.flatnonzero(sample["answer"] > 0)[0]) + 1  # the answer's first token is predicted here
        prompt = Prompt(sample["ids"][:end], pixel_values_videos=expand_patches(sample["patches"], cfg.data.image),
                        video_grid_thw=sample["grids"].astype(np.int64))
        ids = _hf_ids(hf, prompt, tok, 16)
        assert row["generated"] == inference.engine.decode_text(tok, np.asarray(ids), inference.stop_ids_of(tok))


def test_cli_run_dir_restores_params_only(tmp_path):
    """A run saved under FSDP over 8 devices: --run-dir restores only its params, onto one device; the
    CLI, ``answer_questions`` on a held-out VQA record (the end-of-run summary's path) and the same on
    the run's own 8-device sharded params agree."""
    import dataclasses

    import jax
    from flax import nnx

    from moevlm_jax.config import load_config, save_config
    from moevlm_jax.data.config import VqaConfig
    from moevlm_jax.data.records import decode_record
    from moevlm_jax.data.vqa import make_record
    from moevlm_jax.training.checkpoint import Checkpointer
    from moevlm_jax.training.trainer import Trainer

    cfg = load_config("cpu-default", model="tiny", num_devices=8, num_processes=1)
    assert cfg.layout.name == "fsdp"
    trainer = Trainer.create(cfg.model, cfg.compute, cfg.layout, cfg.optimizer, steps=2)
    # the train state's exact tree, dtypes and FSDP shardings, random values (no compiled init)
    rng = np.random.default_rng(0)

    def fill(a):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.device_put(jax.random.key(3), a.sharding)
        return jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding)

    state = jax.tree.map(fill, trainer.abstract_state())
    assert len(jax.tree.leaves(state["params"])[0].sharding.device_set) == 8
    run = tmp_path / "run"
    save_config(cfg, run)
    with Checkpointer(run / "checkpoints", save_every=1, async_save=False) as ckpt:
        assert ckpt.save(2, state, {"batches": 2}, force=True)

    loaded = inference.load_run(run)
    assert loaded.step == 2 and loaded.image_config == cfg.data.image
    ours = nnx.to_pure_dict(nnx.state(loaded.model))
    flat_ours = dict(jax.tree_util.tree_flatten_with_path(ours)[0])
    flat_saved = dict(jax.tree_util.tree_flatten_with_path(state["params"])[0])
    assert flat_ours.keys() == flat_saved.keys()
    for k, v in flat_ours.items():
        assert len(v.devices()) == 1
        np.testing.assert_array_equal(np.asarray(v), np.asarray(flat_saved[k]))

    record = decode_record(make_record(dataclasses.asdict(VqaConfig()), "heldout", 0))
    questions = inference.record_questions(record)[:1]
    (images, messages, answer), = questions
    (tmp_path / "q.jpg").write_bytes(images[0])
    question = inference.question_text(messages)
    (tmp_path / "q.jsonl").write_text(json.dumps({"images": ["q.jpg"], "prompt": question, "answer": answer}))
    cli = json.loads(_run_cli(["--run-dir", str(run), "--step", "2", "--questions", str(tmp_path / "q.jsonl"),
                               "--max-new-tokens", "4", "--quiet"]))
    assert cli["answer"] == answer and len(cli["token_ids"]) > 0

    kw = dict(image_config=cfg.data.image, system_prompt=cfg.data.system_prompt, max_new_tokens=4)
    rows = inference.answer_questions(loaded.model, loaded.tokenizer, questions, **kw)
    assert rows == [{"question": question, "answer": answer, "generated": cli["generated"], "match": cli["match"]}]
    sharded = inference.model_for_generation(cfg.model, cfg.compute, state["params"])  # the trainer's params
    assert inference.answer_questions(sharded, loaded.tokenizer, questions, **kw) == rows
