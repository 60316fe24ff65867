"""The experts' kernel choices: the ``compute.moe.kernels`` section (:class:`KernelsConfig`).

Which fusions and GPU kernels the experts of the ``triton`` grouped-matmul backend use, and the tiles of those
kernels. The values reach the kernels as arguments when the experts are traced (``experts_forward(...,
kernels=...)``, carried by ``dispatch.MoeOptions``), so a run's ``config.yaml`` says which kernels it used and two
configurations can be traced side by side in one process. The defaults are the fastest measured on an H200
(bench/results/moe_layer.md). Every choice applies only where its kernel can run: the Mosaic-GPU kernels on Hopper in
bf16 at shapes they take, the Triton kernels on any GPU (and in Pallas' interpret mode on CPU, for tests); elsewhere
the experts run as without it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from moevlm_jax.parallelism import gmm_mgpu, gmm_triton
from moevlm_jax.schema import near_miss

Fusion = Literal["gather", "mgpu_dswiglu", "mgpu_dweighted"]
PermuteKernel = Literal["dispatch", "combine_bwd"]
MosaicMatmul = Literal["fwd", "dx", "dw"]
FUSIONS: tuple[str, ...] = ("gather", "mgpu_dswiglu", "mgpu_dweighted")
PERMUTE_KERNELS: tuple[str, ...] = ("dispatch", "combine_bwd")
MOSAIC_GPU_MATMULS: tuple[str, ...] = ("fwd", "dx", "dw")
# fusions that were measured slower than the path without them and removed (bench/results/moe_layer.md)
REMOVED_FUSIONS = {
    "gather_dw": "the d(w) kernel reading x through the row index was slower than reading the gathered rows",
    "swiglu": "SwiGLU in the gate_up forward's epilogue cost more than the elementwise pass it replaced",
    "swiglu_bwd": "SwiGLU's backward in the Triton d(x) epilogue cost more than the elementwise pass it replaced",
}
_TRITON_KEY = re.compile(r"^(fwd|dx|dw)(:\d+x\d+)?$")


def _names(where: str, values: Any, known: Sequence[str], removed: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """``values`` (a list of names) as a tuple, each checked against ``known``; a ValueError names the bad one."""
    if isinstance(values, str) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{where}: expected a list of names from {list(known)}, got {values!r}")
    for v in values:
        if removed and v in removed:
            raise ValueError(f"{where}: '{v}' was removed ({removed[v]}; bench/results/moe_layer.md); "
                             f"known: {list(known)}")
        if v not in known:
            raise ValueError(f"{where}: unknown '{v}'{near_miss(str(v), known)} (known: {list(known)})")
    if len(set(values)) != len(values):
        raise ValueError(f"{where}: {list(values)} names one twice")
    return tuple(values)


def _positive_ints(where: str, obj: Any, zero_ok: Sequence[str] = ()) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name == "kernel":
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if f.name in zero_ok else 1):
            raise ValueError(f"{where}.{f.name} must be an int {'>= 0' if f.name in zero_ok else '> 0'}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class TritonTile:
    """One entry over the Triton grouped-matmul tile table (``gmm_triton.CONFIGS``)."""

    # fwd | dx | dw, optionally ':KxN' for one shape (gmm: contraction x output columns; tgmm: its output's K x N)
    kernel: str
    block_m: int = 128  # rows per tile (tgmm: rows per step)
    block_n: int = 128  # output columns per tile
    block_k: int = 64  # contraction per step (tgmm: output rows per tile)
    num_warps: int = 8  # Triton launch: warps per program
    num_stages: int = 3  # Triton launch: software pipeline stages

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, str) or not _TRITON_KEY.match(self.kernel):
            raise ValueError(f"triton tile kernel {self.kernel!r} is not fwd, dx or dw (optionally ':KxN', e.g. "
                             f"'dw:2048x1536')")
        _positive_ints(f"triton tile '{self.kernel}'", self)
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"triton tile '{self.kernel}'.{name} must be a power of two, got {v}")

    def config(self) -> gmm_triton.Config:
        return gmm_triton.Config(self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages)


@dataclasses.dataclass(frozen=True)
class MosaicGpuTiles:
    """Tiles of the Mosaic-GPU kernels per matmul (defaults: ``gmm_mgpu.CONFIGS``, the tuned ones); a field given
    replaces that field of the default."""

    fwd: gmm_mgpu.Config = gmm_mgpu.Config()  # the forward grouped matmul (gmm_mgpu.gmm)
    dx: gmm_mgpu.Config = gmm_mgpu.Config()  # d(x): the forward kernel on the weights read transposed
    dw: gmm_mgpu.TConfig = gmm_mgpu.TConfig()  # d(w): gmm_mgpu.tgmm

    def __post_init__(self) -> None:
        for name, tp in (("fwd", gmm_mgpu.Config), ("dx", gmm_mgpu.Config), ("dw", gmm_mgpu.TConfig)):
            v = getattr(self, name)
            if isinstance(v, Mapping):
                v = tp(**v)
                object.__setattr__(self, name, v)
            if not isinstance(v, tp):
                raise TypeError(f"compute.moe.kernels.mosaic_gpu_tiles.{name}: expected {tp.__name__} fields, "
                                f"got {v!r}")


@dataclasses.dataclass(frozen=True)
class KernelsConfig:
    """The ``compute.moe.kernels`` section: the fusions and GPU kernels of the ``triton`` experts backend."""

    # fusions of the Triton experts (not under FP8): gather = the gate_up kernel reads the token rows through the
    # routing index (no dispatch gather; where the gate_up forward is not on Mosaic-GPU) | mgpu_dweighted = local
    # experts: routing weights applied in SwiGLU, its backward in the Mosaic-GPU d(x) epilogue (Hopper) |
    # mgpu_dswiglu = the same epilogue without the weights, for the all-to-all / all-gather dispatchers
    fusions: tuple[Fusion, ...] = ("gather", "mgpu_dweighted")
    # Triton row kernels of the local sorted experts: dispatch (each token row scattered to its slots) |
    # combine_bwd (the combine's backward in one pass); else XLA's gathers
    permute_kernels: tuple[PermuteKernel, ...] = ("dispatch", "combine_bwd")
    # the matmuls that run on the Mosaic-GPU kernels on Hopper in bf16 (fwd, dx: gmm_mgpu.gmm; dw: gmm_mgpu.tgmm);
    # the others, and every matmul elsewhere, on the Triton kernels
    mosaic_gpu: tuple[MosaicMatmul, ...] = ("fwd", "dx", "dw")
    mosaic_gpu_tiles: MosaicGpuTiles = MosaicGpuTiles()  # tiles of the Mosaic-GPU kernels (a field overrides one)
    # entries over the built-in Triton tile table, e.g. [{kernel: 'dw:2048x1536', block_m: 32, num_warps: 4}]
    triton_tiles: tuple[TritonTile, ...] = ()

    @classmethod
    def __normalize__(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """A removed fusion says why it went (before the loader's list check)."""
        fusions = raw.get("fusions")
        if isinstance(fusions, (list, tuple)):
            _names("fusions", [f for f in fusions if f in REMOVED_FUSIONS], FUSIONS, REMOVED_FUSIONS)
        return raw

    def __post_init__(self) -> None:
        w = "compute.moe.kernels"
        object.__setattr__(self, "fusions", _names(f"{w}.fusions", self.fusions, FUSIONS, REMOVED_FUSIONS))
        object.__setattr__(self, "permute_kernels",
                           _names(f"{w}.permute_kernels", self.permute_kernels, PERMUTE_KERNELS))
        object.__setattr__(self, "mosaic_gpu", _names(f"{w}.mosaic_gpu", self.mosaic_gpu, MOSAIC_GPU_MATMULS))
        tiles = self.mosaic_gpu_tiles
        if isinstance(tiles, Mapping):
            tiles = MosaicGpuTiles(**tiles)
        if not isinstance(tiles, MosaicGpuTiles):
            raise TypeError(f"{w}.mosaic_gpu_tiles: expected a mapping of fwd / dx / dw, got {tiles!r}")
        object.__setattr__(self, "mosaic_gpu_tiles", tiles)
        entries = self.triton_tiles
        if isinstance(entries, Mapping) or not isinstance(entries, (list, tuple)):
            raise TypeError(f"{w}.triton_tiles: expected a list of entries, got {entries!r}")
        entries = tuple(TritonTile(**e) if isinstance(e, Mapping) else e for e in entries)
        if not all(isinstance(e, TritonTile) for e in entries):
            raise ValueError(f"{w}.triton_tiles: expected entries with a 'kernel' key, got {entries!r}")
        keys = [e.kernel for e in entries]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{w}.triton_tiles: {keys} names one kernel twice")
        object.__setattr__(self, "triton_tiles", entries)

    def fused(self, fusion: str) -> bool:
        """Whether ``fusion`` is chosen."""
        return fusion in self.fusions

    def triton_config(self, kind: str, k: int, n: int) -> gmm_triton.Config:
        """The Triton kernel ``kind``'s tiles at contraction / output sizes ``k`` x ``n``: the entry for that shape,
        else the kind's, from :attr:`triton_tiles` over the built-in table."""
        table = {**gmm_triton.CONFIGS, **{e.kernel: e.config() for e in self.triton_tiles}}
        return table.get(f"{kind}:{k}x{n}", table[kind])

    def summary(self, backend: str, platform: str) -> str:
        """One line naming the kernels the experts use with grouped-matmul ``backend`` on ``platform``."""
        if backend != "triton":
            return f"experts: backend {backend} on {platform} (compute.moe.kernels does not apply)"
        hopper = platform in ("gpu", "cuda") and gmm_mgpu.on_hopper()
        mosaic = ",".join(self.mosaic_gpu) if hopper and self.mosaic_gpu else "none"
        fusions = [f for f in self.fusions if hopper or not f.startswith("mgpu_")]
        where = "Hopper" if hopper else platform + (" (Pallas interpret mode)" if platform == "cpu" else "")
        return (f"experts: Triton grouped matmuls on {where}; Mosaic-GPU matmuls: {mosaic}; fusions: "
                f"{','.join(fusions) or 'none'}; row kernels: {','.join(self.permute_kernels) or 'none'}; "
                f"Triton tile entries: {len(self.triton_tiles)}")


DEFAULT_KERNELS = KernelsConfig()
# the environment variables that once chose these kernels; only the MoE layer benchmark reads them now (as overrides)
LEGACY_ENV = {"MOEVLM_MOE_FUSE": "fusions", "MOEVLM_PERMUTE_KERNELS": "permute_kernels",
              "MOEVLM_GMM_MGPU": "mosaic_gpu", "MOEVLM_GMM_MGPU_TUNE": "mosaic_gpu_tiles",
              "MOEVLM_GMM_TRITON_CONFIGS": "triton_tiles"}


def ignored_environment(environ: Mapping[str, str]) -> list[str]:
    """The legacy kernel variables set in ``environ``, each with the ``compute.moe.kernels`` key that replaces it
    (a run ignores them: its kernels are its config's)."""
    return [f"${var} (now compute.moe.kernels.{key})" for var, key in LEGACY_ENV.items() if var in environ]


def load_triton_tiles(path: str) -> tuple[TritonTile, ...]:
    """Entries for :attr:`KernelsConfig.triton_tiles` from a JSON file ``{"fwd"|"dx"|"dw"[":KxN"]: {field: value}}``
    (what a tile sweep writes)."""
    import json

    with open(path) as f:
        raw = json.load(f)
    unknown = sorted(k for k in raw if not _TRITON_KEY.match(k))
    if unknown:
        raise ValueError(f"{path}: unknown kernels {unknown}; known: fwd, dx, dw, each optionally ':KxN'")
    return tuple(TritonTile(kernel=k, **fields) for k, fields in raw.items())
