"""Capture: Megatron's CUDA-graph scope names -> XLA GPU command-buffer flags, merged into
XLA_FLAGS before the backend starts (an error after it started with other flags), and accepted by
this jaxlib's XLA flag parser (checked in a fresh process: XLA aborts on an unknown type)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.training import capture

ALL = "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,COLLECTIVES,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION,CONVOLUTION"


def test_flag_mapping():
    assert capture.capture_flags("none") == {"--xla_gpu_enable_command_buffer": ""}
    assert capture.capture_flags("step") == {}  # one jit, XLA's default command buffers
    default = ComputeConfig(capture="scopes")  # Megatron's safe MoE default: attn moe_router moe_preprocess
    assert capture.compute_flags(default) == {
        "--xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION",
        "--xla_gpu_graph_min_graph_size": "2"}
    assert capture.capture_flags("scopes",
                                 ["attn"])["--xla_gpu_enable_command_buffer"] == "FUSION,CUBLAS,CUBLASLT,CUDNN"
    assert capture.capture_flags("scopes",
                                 ["moe_router"])["--xla_gpu_enable_command_buffer"] == "FUSION,CUBLAS,CUBLASLT"
    assert capture.capture_flags("scopes", ["moe_preprocess"])["--xla_gpu_enable_command_buffer"] == \
        "FUSION,DYNAMIC_SLICE_FUSION"
    assert capture.capture_flags("scopes", ["attn", "full_iteration"]) == {
        "--xla_gpu_enable_command_buffer": ALL, "--xla_gpu_graph_min_graph_size": "1"}
    assert capture.describe("none") == "none: --xla_gpu_enable_command_buffer="
    with pytest.raises(ValueError, match="unknown capture scopes"):
        capture.capture_flags("scopes", ["mlp"])
    with pytest.raises(ValueError, match="at least one scope"):
        capture.capture_flags("scopes", [])
    with pytest.raises(ValueError, match="capture must be one of"):
        capture.capture_flags("graphs")


def test_merge_into_xla_flags():
    have = "--xla_force_host_platform_device_count=8 --xla_gpu_enable_command_buffer=FUSION"
    merged = capture.merge_flags(have, capture.capture_flags("scopes", ["full_iteration"]))
    assert merged == (f"--xla_force_host_platform_device_count=8 --xla_gpu_enable_command_buffer={ALL} "
                      "--xla_gpu_graph_min_graph_size=1")
    assert capture.merge_flags(have, capture.capture_flags("none")) == \
        "--xla_force_host_platform_device_count=8 --xla_gpu_enable_command_buffer="
    assert capture.merge_flags(have, {}) == have
    assert capture.parse_flags(merged)["--xla_gpu_graph_min_graph_size"] == "1"


def test_apply_after_the_backend_started():
    import jax

    jax.devices()  # the backend runs in the test process
    assert capture.backend_started()
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert capture.apply_capture("step", environ=env) == env["XLA_FLAGS"]  # nothing to change
    with pytest.raises(capture.CaptureError, match="already started"):
        capture.apply_capture(ComputeConfig(capture="none"), environ=env)
    env = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer= --xla_force_host_platform_device_count=8"}
    assert capture.apply_capture("none", environ=env) == env["XLA_FLAGS"]  # already in effect: fine


def test_xla_parses_the_flags_before_the_backend_starts():
    """A fresh process: apply_capture sets XLA_FLAGS, then the backend starts with them."""
    code = ("import os; from moevlm_jax.training import capture; "
            "print(capture.apply_capture('scopes', ['attn', 'full_iteration'])); "
            "import jax; jax.devices(); print(capture.apply_capture('scopes', ['full_iteration']))")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == lines[1] == (f"--xla_force_host_platform_device_count=2 --xla_gpu_enable_command_buffer={ALL} "
                                    "--xla_gpu_graph_min_graph_size=1")


def test_recipe_capture_reads_without_jax(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("compute: {capture: scopes, capture_scopes: [attn]}\n")
    assert capture.recipe_capture(str(recipe)) == ("scopes", ("attn",))
    assert capture.recipe_capture(str(recipe), ["compute.capture=none", "optimizer.lr=1"]) == ("none", ("attn",))
    assert capture.recipe_capture(None) == ("step", ("attn", "moe_router", "moe_preprocess"))
    with pytest.raises(ValueError, match="compute.capture: 'graph' is not one of"):
        capture.recipe_capture(str(recipe), ["compute.capture=graph"])


def test_compute_xla_flags_join_the_capture_flags(tmp_path):
    """compute.xla_flags: set with the capture's flags (replacing the same flags in XLA_FLAGS), read from a
    recipe and its overrides without jax, and parsed by XLA in a fresh process."""
    compute = ComputeConfig(capture="none", xla_flags=("--xla_gpu_enable_triton_gemm=false",))
    assert capture.compute_flags(compute) == {"--xla_gpu_enable_command_buffer": "",
                                              "--xla_gpu_enable_triton_gemm": "false"}
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true --xla_force_host_platform_device_count=2"}
    assert capture.merge_flags(env["XLA_FLAGS"], capture.compute_flags(compute)) == (
        "--xla_force_host_platform_device_count=2 --xla_gpu_enable_command_buffer= --xla_gpu_enable_triton_gemm=false")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("compute: {capture: none, xla_flags: [--xla_gpu_enable_triton_gemm=false]}\n")
    assert capture.recipe_compute(str(recipe)).xla_flags == ("--xla_gpu_enable_triton_gemm=false",)
    assert capture.recipe_compute(str(recipe), ["compute.xla_flags=[]"]).xla_flags == ()
    for bad, match in [(("xla_gpu_enable_triton_gemm=false",), "entries are"),
                       (("--xla_gpu_enable_triton_gemm",), "entries are"),
                       (("--xla_gpu_graph_min_graph_size=3",), "is compute.capture's"),
                       (("--xla_a=1", "--xla_a=2"), "twice")]:
        with pytest.raises(ValueError, match=match):
            ComputeConfig(xla_flags=bad)
    code = ("from moevlm_jax.training import capture; from moevlm_jax.model.compute import ComputeConfig; "
            "capture.apply_capture(ComputeConfig(capture='none', xla_flags=('--xla_gpu_enable_triton_gemm=false',))); "
            "import jax; print(jax.numpy.ones(3).sum())")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0 and done.stdout.strip() == "3.0", done.stderr[-2000:]


def test_train_cli_sets_the_flags_before_the_backend_starts():
    """The train CLI applies compute.capture before the recipe loader starts jax (here the run then
    stops at a config error, after the backend started with the flags)."""
    code = ("import os, jax; from moevlm_jax import train; from moevlm_jax.training import capture; "
            "rc = train.main(['--recipe', 'cpu-default', 'compute.capture=none', 'train.stepz=3']); "
            "print(rc, capture.backend_started(), repr(os.environ['XLA_FLAGS']))")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == \
        "2 True '--xla_force_host_platform_device_count=2 --xla_gpu_enable_command_buffer='"
    assert "unknown key 'train.stepz'" in done.stderr
