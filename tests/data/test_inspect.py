"""``python -m moevlm_jax.data.inspect``: one batch of the built-in set printed, its text decoded with the run's
tokenizer and its trained targets the answers the records hold."""

import os

from moevlm_jax.data.inspect import main


def test_inspect_prints_a_batch_with_its_decoded_text(capsys):
    assert main(["vqa", "--set", "source.num_train=8", "--set", "source.num_heldout=2", "--set",
                 f"cache_dir={os.environ['MOEVLM_TEST_DATA_CACHE']}/inspect"]) == 0
    out = capsys.readouterr().out
    assert "batch 0:" in out and "input_ids" in out and "<|im_start|>user" in out
    targets = next(line for line in out.splitlines() if "trained targets:" in line)
    assert targets.count("<|im_end|>") >= 8  # every sample's answer, then its end of turn
