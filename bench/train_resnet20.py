"""ResNet-20 trained on digits by sparse-scan and by PyTorch, from the same weights on the same batches.

The network is ``bench/resnet20.py``'s torchvision-style ResNet-20 with PyTorch's initial weights and
frozen batch norms (``net.eval()``: running statistics 0 and 1, their scale and shift trained), in
``--dtype`` (float32 by default; float64 shows the two runs agree to rounding, since in float32 the
rounding differences of two correct implementations grow once the network learns).
``export_torch`` writes it as a spec; sparse-scan trains the loaded model with
:func:`sparse_scan.train.train` (the gradients of ``--method``, Adam with PyTorch's rules) and PyTorch
trains the module with ``torch.optim.Adam`` and autograd, on the digits as ``sparse-scan train --data
digits`` sees them (8x8, zero-padded to 32x32, the grey level in the three channels) and in the same
order (``train``'s: ``numpy.random.default_rng(seed).permutation`` per epoch). Both evaluate the
test set after every step, as ``train`` does.

Prints JSON: per iteration both training losses (each batch's, before its step) and test losses, the
largest difference of each, both final test accuracies, and the wall seconds of both loops.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from typing import Any

import numpy as np

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from resnet20 import torch_resnet20  # noqa: E402 - the bench folder is not a package


def train_torch(net: Any, data: Any, args: argparse.Namespace) -> tuple[list[dict[str, float]], float]:
    """PyTorch's run: the same batches, Adam, a test evaluation after every step."""
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    x_test, y_test = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    rng = np.random.default_rng(args.seed)
    records = []
    started = time.perf_counter()
    for _ in range(args.epochs):
        order = rng.permutation(len(data.x_train))
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            loss = F.cross_entropy(net(torch.from_numpy(data.x_train[batch])),
                                   torch.from_numpy(data.y_train[batch]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                logits = net(x_test)
                test_loss = float(F.cross_entropy(logits, y_test))
                accuracy = float((logits.argmax(1) == y_test).double().mean())
            records.append({"train_loss": float(loss.detach()), "test_loss": test_loss,
                            "test_accuracy": accuracy})
    return records, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--method", default="linear")
    parser.add_argument("--levels", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args()

    import torch

    from sparse_scan import export_torch, load_model
    from sparse_scan.optim import Adam
    from sparse_scan.train import load_dataset, train

    torch.manual_seed(args.seed)
    net = torch_resnet20(args.seed, random_statistics=False).to(getattr(torch, args.dtype))
    with tempfile.TemporaryDirectory() as folder:
        model = load_model(export_torch(net, (3, 32, 32), pathlib.Path(folder) / "resnet20.yaml"),
                           dtype=args.dtype)
    data = load_dataset("digits", model.input_shape, 10, dtype=args.dtype)
    ours = train(model, data, Adam(model, lr=args.lr), epochs=args.epochs, batch_size=args.batch_size,
                 method=args.method, levels=args.levels, seed=args.seed)
    theirs, torch_seconds = train_torch(net, data, args)
    rows = [{"iteration": r["iteration"], "train_loss": r["train_loss"], "torch_train_loss": t["train_loss"],
             "test_loss": r["test_loss"], "torch_test_loss": t["test_loss"]}
            for r, t in zip(ours, theirs, strict=True)]
    print(json.dumps({
        "benchmark": "ResNet-20 on digits: sparse-scan train vs PyTorch, same weights and batches",
        "method": args.method, "levels": args.levels, "epochs": args.epochs, "batch_size": args.batch_size,
        "optimizer": f"adam lr={args.lr}", "dtype": args.dtype, "iterations": len(rows),
        "max_train_loss_difference": max(abs(r["train_loss"] - r["torch_train_loss"]) for r in rows),
        "max_test_loss_difference": max(abs(r["test_loss"] - r["torch_test_loss"]) for r in rows),
        "test_accuracy": ours[-1]["test_accuracy"], "torch_test_accuracy": theirs[-1]["test_accuracy"],
        "seconds": ours[-1]["elapsed_s"], "torch_seconds": torch_seconds,
        "torch_threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
