#!/usr/bin/env python3
"""Compares scripts/gpu/families_check.sh's CUDA logits with the transformers record of each
tiny fixture (tests/fixtures/tiny/<family>/logits.f32, rows from the last prompt position on;
dump-logits writes the rows after each later token, so the record's first row is skipped).

    python3 scripts/gpu/families_compare.py DIR     (DIR: the files fetched from $OUT)
"""
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def main(out: Path) -> None:
    for dir in sorted((ROOT / "tests/fixtures/tiny").iterdir()):
        rec = json.loads((dir / "logits.json").read_text())
        want = np.fromfile(dir / rec["logits_file"], dtype="<f4").reshape(rec["logits_shape"])[1:]
        for kind in ["folder", "gguf"]:
            f = out / f"{dir.name}-{kind}.f32"
            if not f.exists():
                print(f"{dir.name:<9} {kind:<6} missing")
                continue
            got = np.fromfile(f, dtype="<f4").reshape(want.shape)
            top = np.sort(want, axis=-1)
            clear = (top[:, -1] - top[:, -2]) > 0.1
            same = (got.argmax(-1) == want.argmax(-1))[clear].all()
            print(f"{dir.name:<9} {kind:<6} max |Δ| {np.abs(got - want).max():.3e}  "
                  f"top-1 equal on {clear.sum()} clear positions: {bool(same)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
