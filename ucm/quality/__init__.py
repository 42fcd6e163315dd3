"""Quality harness for UCM's approximations: accuracy, exact match and log-prob drift against the dense baseline.

- ``python -m ucm.quality --model DIR [--config ucm.yaml] [--short]``: see ``ucm/quality/__main__.py``.
- ``harness.run_quality``: the same from Python; ``tasks``: the evaluation sets; ``recall`` / ``train_recall``: the
  synthetic recall task and the script that trained the small model shipped in ``assets/recall-llama``.

Nothing heavy is imported here.
"""

from pathlib import Path

RECALL_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "recall-llama"
"""UCM's trained recall model (2-layer Llama, float32, word-level tokenizer), committed with its training log."""
