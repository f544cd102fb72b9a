"""Same global batch, four layouts: how far apart are the per-step losses and the trained weights? (issue 20)

The fine-tuning recipe trains a tiny random Llama for 6 steps in fp32 on chat
data whose sequences carry from ~10 to ~90 target tokens, with 4 sequences
per optimizer step laid out as one process x batch 4, one process x batch 1
x accumulation 4, and 2 ranks x batch 1 x accumulation 2 under DDP and under
FSDP (CPU, gloo), without and with packing. It prints, per layout against
the first, the largest relative per-step loss difference, the largest
difference of the exported weights, and whether every step trained on the
same sequences (the run's data order, recorded per step on every rank).
The runs and the data are tests/helpers/global_batch.py's, which
tests/recipes/test_global_batch_loss.py asserts on.

    python benchmarks/global_batch_loss.py            # results as a Markdown table, plus JSON
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.join(HERE, "..", "src"), os.path.join(HERE, "..", "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers.global_batch import build_assets, compare, run_layouts  # noqa: E402


def main() -> None:
    rows = {}
    with tempfile.TemporaryDirectory() as root:
        model_dir, data = build_assets(root)
        for packing in (False, True):
            results = run_layouts(model_dir, data, os.path.join(root, f"packing-{packing}"), packing)
            rows[packing] = compare(results)
    print(f"measured {datetime.date.today().isoformat()}")
    print(
        "| packing | layout | largest per-step loss difference (relative) | largest weight difference | same batches |"
    )
    print("|---|---|---|---|---|")
    for packing, report in rows.items():
        for name, gap in report.items():
            print(
                f"| {'yes' if packing else 'no'} | {name} | {gap['max_rel_loss']:.2e} | "
                f"{gap['max_weight']:.2e} | {gap['same_batches']} |"
            )
    print(json.dumps({str(k): v for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
