"""Bad configurations through the train CLI: every malformed setting (wrong type, unknown key,
impossible or negative size, missing file, axes that do not divide) ends with exit code 2 and a line
per problem naming its key (one line for one problem), before anything compiles, never a traceback."""

from __future__ import annotations

import pytest

from moevlm_jax.train import main

BASE = ["--recipe", "cpu-default", "--model", "tiny", "--quiet", "--run-dir"]

# (extra command-line arguments, text the one error line must contain)
CASES = [
    (["train.stepz=3"], "train.stepz"),
    (["train.steps=abc"], "train.steps"),
    (["train.steps=-1"], "train.steps"),
    (["train.steps=0"], "train.steps"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["train.micro_batch_size=1.5"], "train.micro_batch_size"),
    (["train.grad_accum=-2"], "train.grad_accum"),
    (["train.seq_len=1"], "train.seq_len"),
    (["train.log_every=0"], "train.log_every"),
    (["train.eval_every=-1"], "train.eval_every"),
    (["train.keep_checkpoints=0"], "train.keep_checkpoints"),
    (["train.checkpoint_host_gb=0"], "train.checkpoint_host_gb"),
    (["train.freeze_vision_model=maybe"], "train.freeze_vision_model"),
    (["train.global_batch_size=7"], "train.global_batch_size"),
    (["train.init_from=/nonexistent/hf_model"], "train.init_from"),
    (["train.param_groups={vision_modle: [x]}"], "train.param_groups.vision_modle"),
    (["train.param_groups={vision_model: ['(']}"], "train.param_groups.vision_model"),
    (["train.eval_every=5", "train.eval_batches=0"], "train.eval_batches"),
    (["train.profile_steps=2", "train.profile_start_step=5000"], "train.profile_start_step"),
    (["train.compile=eager"], "train.compile"),
    (["train.compile_bucket=512"], "train.compile_bucket"),
    (["train.reuse_shapes=false", "train.compile=ahead"], "train.compile"),
    (["train.compile_ahead=true", "train.reserve_largest_bucket=false"], "train.compile"),
    (["optimizer.lr=-1"], "optimizer.lr"),
    (["optimizer.lr=zero"], "optimizer.lr"),
    (["optimizer.schedule=cosin"], "optimizer.schedule"),
    (["optimizer.min_lr_ratio=2"], "optimizer.min_lr_ratio"),
    (["optimizer.b1=x"], "optimizer.b1"),
    (["optimizer.b2=1.5"], "optimizer.b2"),
    (["optimizer.state_dtype=fp8"], "optimizer.state_dtype"),
    (["optimizer.no_decay_patterns=norm"], "optimizer.no_decay_patterns"),
    (["optimizer.no_decay_patterns=['[']"], "optimizer.no_decay_patterns"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay"),
    (["optimizer.clip_grad_norm=-1"], "optimizer.clip_grad_norm"),
    (["optimizer.eps=0"], "optimizer.eps"),
    (["compute.dtype=fp8"], "compute.dtype"),
    (["compute.attention=flash"], "compute.attention"),
    (["compute.recompute=some"], "compute.recompute"),
    (["compute.recompute_modules=[attn]"], "compute.recompute_modules"),
    (["compute.offload=[attention]"], "compute.offload"),
    (["compute.capture=graphs"], "compute.capture"),
    (["compute.moe.backend=fast"], "compute.moe.backend"),
    (["compute.moe.capacity_factor=-1"], "compute.moe.capacity_factor"),
    (["compute.moe.backend=capacity"], "compute.moe.capacity_factor"),
    (["compute.moe.dispatcher=alltoall"], "compute.moe.dispatcher"),
    (["--layout", "ep", "compute.moe.dispatcher=hierarchical"], "compute.moe.dispatcher 'hierarchical' needs the "
     "experts split over a mesh axis that may cross hosts"),
    (["compute.router.aux_loss=seq"], "compute.router.aux_loss"),
    (["compute.router.z_loss_coef=-1"], "compute.router.z_loss_coef"),
    (["compute.loss_chunk_size=0"], "compute.loss_chunk_size"),
    (["compute.attention_options.max_segments=0"], "compute.attention_options.max_segments"),
    (["compute.attention_options.vision_pad_head_dim=100"], "compute.attention_options.vision_pad_head_dim"),
    (["compute.vision_recompute=all"], "compute.vision_recompute"),
    (["compute.bogus=1"], "compute.bogus"),
    (["model.text_config.num_expert=4"], "model.text_config.num_expert"),
    (["model.text_config.hidden_size=-64"], "model.text_config.hidden_size"),
    (["model.text_config.num_key_value_heads=0"], "model.text_config.num_key_value_heads"),
    (["model.text_config.num_attention_heads=3"], "model.text_config.num_attention_heads"),
    (["model.text_config.num_experts_per_tok=100"], "model.text_config.num_experts_per_tok"),
    (["model.text_config.vocab_size=1000"], "model.text_config.vocab_size"),
    (["model.vision_config.num_heads=5"], "model.vision_config.num_heads"),
    (["model.vision_config.deepstack_visual_indexes=[99]"], "model.vision_config.deepstack_visual_indexes"),
    (["model.text_config=5"], "model.text_config"),
    (["--model", "no-such-model"], "models config 'no-such-model'"),
    (["--layout", "no-such-layout"], "layouts config 'no-such-layout'"),
    (["--data", "no-such-data"], "data config 'no-such-data'"),
    (["--recipe", "no-such-recipe"], "recipes config 'no-such-recipe'"),
    (["layout.mesh.tensr=2"], "layout.mesh.tensr"),
    (["layout.mesh={fsdp: 3}"], "layout.mesh"),
    (["--layout", "tp", "layout.mesh={tensor: 3, fsdp: -1}"], "layout.mesh"),
    (["--layout", "tp", "layout.mesh={tensor: 8}"], "kv_heads"),
    (["--layout", "ep", "model.text_config.num_experts=6"], "num_experts"),
    (["layout.rules=[[foo, fsdp]]"], "layout.rules"),
    (["layout.rules=[[embed, fsdb]]"], "layout.rules"),
    (["layout.options.pipeline.schedule=zigzag"], "layout.options.pipeline.schedule"),
    (["layout.options.context_parallel=spiral"], "layout.options.context_parallel"),
    (["data.seq_len=128"], "data.seq_len"),
    (["data.batch_size=4"], "data.batch_size"),
    (["data.source.kind=parquet"], "data.source.kind"),
    (["data.source.num_trian=5"], "data.source.num_trian"),
    (["data.image.bogus=1"], "data.image.bogus"),
    (["data.patch_buckets=[6, 8]"], "data.patch_buckets"),
    (["data.workers=-1"], "data.workers"),
    (["data.image.min_pixels=999999999"], "data.image.min_pixels"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer"),
    (["optimiser.lr=1"], "optimiser"),
    (["train.steps"], "train.steps"),
    (["=3"], "=3"),
]


def test_enough_cases():
    assert len(CASES) >= 50


@pytest.mark.parametrize("extra, key", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_setting_is_one_line_exit_2(tmp_path, capsys, extra, key):
    rc = main(BASE + [str(tmp_path / "run"), *extra])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert errors and all(line.startswith("error:") or " WARNING " in line for line in lines), err
    assert any(key in line for line in errors), errors
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
