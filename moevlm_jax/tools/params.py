"""Parameter counts of a model config, computed on the abstract model (nothing allocated).

``python -m moevlm_jax.tools.params --model NAME`` prints total and active parameters (active: one
token's path, i.e. the top-k experts of each MoE layer instead of all of them; everything else,
vision tower included, counts fully). Totals equal what HF counts for the same config.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import jax
from flax import nnx

from moevlm_jax.hf import abstract_model
from moevlm_jax.model.registry import load_model_config


def param_counts(config: Any) -> dict[str, int]:
    """Parameter counts by part (any model family): vision, embed, decoder, lm_head, total, experts, active
    (the shared experts of Qwen3.5 count as active, like every non-routed parameter)."""

    model = abstract_model(config)
    state = nnx.state(model)

    def size(tree) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))

    t = config.text_config
    counts = {
        "vision": size(state["visual"]),
        "embed": size(state["language_model"]["embed_tokens"]),
        "decoder": size(state["language_model"]) - size(state["language_model"]["embed_tokens"]),
        "lm_head": size(state["lm_head"]) if "lm_head" in state else 0,
    }
    counts["total"] = sum(counts.values())
    n_moe = sum(k == "moe" for k in t.layer_kinds)
    per_expert = 3 * t.hidden_size * t.moe_intermediate_size
    counts["experts"] = n_moe * t.num_experts * per_expert
    counts["active"] = counts["total"] - n_moe * (t.num_experts - t.num_experts_per_tok) * per_expert
    return counts


def main(argv: list[str] | None = None) -> None:
    """CLI: print the parameter counts of ``--model`` (a name in configs/models or a path)."""
    parser = argparse.ArgumentParser(prog="python -m moevlm_jax.tools.params", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="configs/models/NAME.yaml, a YAML/JSON file or an HF dir")
    args = parser.parse_args(argv)
    config = load_model_config(args.model)
    c = param_counts(config)
    print(f"model {config.name or args.model}")
    for key in ("vision", "embed", "decoder", "lm_head", "experts"):
        print(f"  {key:<8} {c[key]:>16,}")
    print(f"  {'total':<8} {c['total']:>16,}  ({c['total'] / 1e9:.2f}B)")
    print(f"  {'active':<8} {c['active']:>16,}  ({c['active'] / 1e9:.2f}B)")


if __name__ == "__main__":
    main()
