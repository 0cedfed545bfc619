"""Write data/lenet5.npz: seeded PyTorch-style initial weights for data/lenet5.yaml.

Run from the repository root: ``python tools/make_lenet5_weights.py [--seed 0] [--force]``. The spec
is loaded with a seeded ``init`` in place of its weights file, and every parameter saved under its
state_dict name, in float32.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np
import yaml

from sparse_scan import load_model

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="overwrite an existing lenet5.npz")
    args = parser.parse_args(argv)
    target = DATA / "lenet5.npz"
    if target.exists() and not args.force:
        print(f"{target} exists (use --force)", file=sys.stderr)
        return 2
    spec = yaml.safe_load((DATA / "lenet5.yaml").read_text())
    del spec["weights"]
    spec["init"] = {"seed": args.seed}
    with tempfile.TemporaryDirectory() as folder:
        seeded = pathlib.Path(folder) / "lenet5.yaml"
        seeded.write_text(yaml.safe_dump(spec))
        model = load_model(seeded)
    weights = {f"{layer.name}.{name}": np.asarray(getattr(layer, name), np.float32)
               for layer in model.layers if hasattr(layer, "weight") for name in ("weight", "bias")}
    np.savez(target, **weights)
    print(f"wrote {target}: {sum(w.size for w in weights.values())} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
