"""bench.trace_breakdown: profiler-trace events -> model components, by hand and on a real trace."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from bench import trace_breakdown as tb

HLO = """HloModule jit__train_step, entry_computation_layout={()->()}

%body (p: f32[4]) -> f32[4] {
  %fusion.1 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%fc1, metadata={op_name="jit(_train_step)/while/body/jvp(decoder_attention)/mul" source_file="a.py" source_line=1}
  %custom-call.2 = f32[4]{0} custom-call(f32[4]{0} %fusion.1), custom_call_target="mosaic_gpu", metadata={op_name="jit(_train_step)/while/body/transpose(jvp(experts))/expert_ffn/ragged_dot_general"}
  ROOT %gather.3 = f32[4]{0} gather(f32[4]{0} %custom-call.2), metadata={op_name="jit(_train_step)/while/body/jvp(experts)/gather"}
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %add.4 = f32[4]{0} add(f32[4]{0} %a, f32[4]{0} %a), metadata={op_name="jit(_train_step)/jvp()/add"}
  ROOT %fusion.5 = f32[4]{0} fusion(f32[4]{0} %add.4), kind=kLoop, calls=%fc5, metadata={op_name="jit(_train_step)/optimizer/mul"}
}
"""


def _meta(pid, name, tid=None, thread=None):
    out = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}]
    if tid is not None:
        out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}})
    return out


def _ev(pid, tid, ts, dur, op=None, module="jit__train_step"):
    args = {"hlo_module": module} if module else {}
    if op:
        args["hlo_op"] = op
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": op or "kernel", "args": args}


def test_hlo_ops_map_to_named_scopes():
    names = tb.op_names(HLO)
    assert tb.module_name(HLO) == "jit__train_step" and len(names) == 5
    assert [tb.component_of(names[k]) for k in ("fusion.1", "custom-call.2", "gather.3", "add.4", "fusion.5")] == [
        "decoder attention", "experts (matmuls + SwiGLU)", "permutation / dispatch", tb.OTHER, "optimizer update"]
    assert tb.component_of("jit(f)/vision_encoder_extra/mul") == tb.OTHER  # whole scope names only
    assert tb.component_of("jit(f)/transpose(jvp(vision_encoder))/dot") == "vision encoder"


def test_device_kernels_are_attributed_and_add_up_to_the_step(tmp_path):
    """GPU-like trace: a compute stream (counted), a host thread with the same ops (not counted),
    another program's kernel (listed apart), a kernel without hlo_op (unattributed) and one with only
    a name-stack argument, and two kernels of a command buffer (a fusion found by its kernel name, a
    library GEMM unmatched). 2 steps of 100 us: by hand, per step (ms) attention 0.010 + 0.006, expert
    matmuls 0.020, dispatch 0.005, router 0.004, other 0.003, optimizer 0.002, unmatched 0.002,
    unattributed 0.001, idle 0.1 - 0.053 = 0.047."""
    events = _meta(1, "/device:GPU:0", 7, "Stream #7(Compute)") + _meta(2, "/host:CPU", 3, "python3")
    for step in range(2):
        t = step * 100
        events += [_ev(1, 7, t, 10, "fusion.1"), _ev(1, 7, t + 10, 20, "custom-call.2"), _ev(1, 7, t + 30, 5,
                                                                                             "gather.3"),
                   _ev(1, 7, t + 35, 3, "add.4"), _ev(1, 7, t + 38, 2, "fusion.5"), _ev(1, 7, t + 40, 1, None),
                   _ev(1, 7, t + 41, 7, "fusion.9", module="jit_prefetch"), _ev(2, 3, t, 50, "fusion.1")]
        named = _ev(1, 7, t + 48, 4, None)  # no hlo_op, but the name stack as an argument
        named["args"]["tf_op"] = "jit(_train_step)/transpose(jvp(router))/dot_general"
        events.append(named)
        # inside a command buffer: hlo_op names the buffer; a fusion's kernel is named after the fusion
        for ts, dur, kernel in ((t + 52, 6, "fusion_1"), (t + 58, 2, "sm90_xmma_gemm_bf16")):
            ev = _ev(1, 7, ts, dur, "command_buffer_12")
            ev["name"] = kernel
            events.append(ev)
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = tb.breakdown(tmp_path, [HLO], steps=2, step_time_s=100e-6)
    want = {"experts (matmuls + SwiGLU)": 0.020, "permutation / dispatch": 0.005, "router": 0.004,
            "decoder attention": 0.016, "optimizer update": 0.002, tb.OTHER: 0.003, tb.UNMATCHED: 0.002,
            tb.UNATTRIBUTED: 0.001, tb.IDLE: 0.047}
    assert got["per_step_ms"].keys() == want.keys()
    for k, v in want.items():
        assert got["per_step_ms"][k] == pytest.approx(v, abs=1e-12), k
    assert got["other_programs_ms"] == pytest.approx({"jit_prefetch": 0.007})
    assert sum(got["per_step_ms"].values()) == pytest.approx(got["step_ms"]) and got["step_ms"] == pytest.approx(0.1)
    assert "decoder attention" in tb.format_table(got)
    top = {(t["row"], t["kernel"]): t["ms_per_step"] for t in got["top_unscoped"]}
    assert top[(tb.UNMATCHED, "sm90_xmma_gemm_bf16")] == pytest.approx(0.002)
    assert top[(tb.OTHER, "add.4")] == pytest.approx(0.003)
    # each row's kernels by kind and its largest kernels (by hand from the events above)
    assert got["kinds_ms"][tb.UNMATCHED] == pytest.approx({"gemm": 0.002})
    assert got["kinds_ms"]["permutation / dispatch"] == pytest.approx({"scatter / gather": 0.005})
    attn = [(t["kernel"], t["ms_per_step"]) for t in got["top_per_component"]["decoder attention"]]
    assert attn == [("fusion.1", pytest.approx(0.010)), ("fusion_1", pytest.approx(0.006))]
    assert "kernel kinds per component" in tb.format_table(got)


def test_idle_gaps_by_the_kernels_around_them():
    """Two streams; by hand (us): k1 [0,10] on A and kb [5,25] on B cover each other, then A idles until
    k2 at 30 (5 us after kb), k3 [40,41] -> k4 [51,60] and k3 [60,61] -> k4 [71,80] wait 10 us each, and
    the next step's k1 starts at 200 (a 120 us step boundary). Two steps."""
    ev = lambda tid, ts, dur, op: _ev(1, tid, ts, dur, op)  # noqa: E731
    events = [ev(7, 0, 10, "k1"), ev(8, 5, 20, "kb"), ev(7, 30, 10, "k2"), ev(7, 40, 1, "k3"), ev(7, 51, 9, "k4"),
              ev(7, 60, 1, "k3"), ev(7, 71, 9, "k4"), ev(7, 200, 10, "k1"), ev(7, 210, 1, "k3")]
    got = tb.idle_gaps(events, steps=2)
    assert got["gap_ms"] == pytest.approx((5 + 10 + 10 + 120) * 1e-3 / 2)
    assert got["count"] == 2 and got["largest_ms"] == pytest.approx([0.120, 0.010])
    sites = [(g["before"], g["after"], g["count_per_step"], g["max_us"]) for g in got["sites"]]
    assert sites == [("k4 [k4]", "k1 [k1]", 0.5, 120), ("k3 [k3]", "k4 [k4]", 1.0, 10), ("kb [kb]", "k2 [k2]", 0.5, 5)]
    assert tb.idle_gaps(events, steps=2, min_us=6)["count"] == 1.5  # the 5 us gap is below the threshold
    text = tb.format_table({"per_step_ms": {tb.IDLE: 0.07}, "step_ms": 0.1, "idle_gaps": got})
    assert "device idle gaps: 0.07 ms/step in 2 gaps a step" in text and "k3 [k3] -> k4 [k4]" in text


def test_kernel_kinds_by_name():
    """Kernel names as they appear in H200 traces."""
    assert tb.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert tb.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert tb.kernel_kind("gmm_triton_kernel") == "gemm"
    assert tb.kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"  # cuBLAS 13
    assert tb.kernel_kind("MemcpyD2D") == "copy"
    assert tb.kernel_kind("Memset 3") == "memset"
    assert tb.kernel_kind("input_scatter_fusion_37") == "scatter / gather"
    assert tb.kernel_kind("input_add_reduce_fusion_10") == "reduction fusion"
    assert tb.kernel_kind("loop_multiply_fusion_3") == "elementwise / other"


def test_a_real_xla_cpu_trace(tmp_path):
    """jax.profiler on XLA:CPU: the compiled program's ops land in the scopes they were traced in."""
    def f(x, w):
        with jax.named_scope("decoder_attention"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("experts"), jax.named_scope("expert_ffn"):
            z = jnp.exp(y @ w)
        return (z * 2.0).sum()

    x, w = jnp.ones((512, 512)), jnp.full((512, 512), 1e-3)
    compiled = jax.jit(jax.value_and_grad(f)).lower(x, w).compile()
    jax.block_until_ready(compiled(x, w))
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    for _ in range(2):
        jax.block_until_ready(compiled(x, w))
    jax.profiler.stop_trace()
    got = tb.breakdown(tmp_path, [compiled.as_text()], steps=2)
    rows = got["per_step_ms"]
    assert rows["decoder attention"] > 0 and rows["experts (matmuls + SwiGLU)"] > 0
    assert tb.UNATTRIBUTED not in rows and got["kernel_ms"] > 0
