"""Where pruning pays (issue 45): the pruned products against the dense ones, per layer and density, to
measure the crossovers of :mod:`sparse_scan.layers._conv_pruned` (``DIRECT_MAX_DENSITY``,
``LINEAR_DIRECT_MAX_DENSITY``, ``SAMPLED_MAX_DENSITY``, ``TRANSPOSED_MAX_DENSITY``).

For each of VGG-11's eight convolutions on 3x32x32 (3x3, padding 1) and a 512x512 Linear layer, each
share of kept weights (random masks) and batch size, the same layer is timed on its sparse and its
dense path, in turn, fresh masks per density:

- ``forward``: the direct sparse convolution (the Linear layer's pruned 1x1 convolution) against
  im2col and the GEMM;
- ``weight_gradient``: the sampled product at the kept weights against the dense GEMM, masked;
- ``input_gradient`` (convolutions): ``JT @ g`` through the weights, the compiled transposed
  convolution over the CSR weights against the dense GEMM and col2im.

Per operation the report gives the ratio dense / sparse (above 1: the sparse path is faster) and the
crossover: the largest density measured at which the sparse path is at least as fast on every layer
and batch. ``--device gpu`` times the GPU twins (CuPy) the same way. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
from common import cpu_pressure, machine

from sparse_scan import backend
from sparse_scan.layers import Conv2d, Linear
from sparse_scan.layers import _conv as conv_module
from sparse_scan.layers import _conv_pruned as pruned_module
from sparse_scan.layers import _linear as linear_module
from sparse_scan.layers import _weighted as weighted_module

VGG11 = [(3, 64, 32), (64, 128, 16), (128, 256, 8), (256, 256, 8), (256, 512, 4), (512, 512, 4),
         (512, 512, 2), (512, 512, 2)]
OPERATIONS = ("forward", "weight_gradient", "input_gradient")


class Paths:
    """Switches every pruned product to its sparse or its dense path (the crossover constants)."""

    NAMES = ((conv_module, "DIRECT_MAX_DENSITY"), (linear_module, "LINEAR_DIRECT_MAX_DENSITY"),
             (weighted_module, "SAMPLED_MAX_DENSITY"), (conv_module, "TRANSPOSED_MAX_DENSITY"))

    def __init__(self) -> None:
        self.saved = [getattr(module, name) for module, name in self.NAMES]

    def use(self, sparse: bool) -> None:
        for module, name in self.NAMES:
            setattr(module, name, 1.0 if sparse else -1.0)

    def restore(self) -> None:
        for (module, name), value in zip(self.NAMES, self.saved, strict=True):
            setattr(module, name, value)


def layer_for(spec: tuple[int, ...] | int, density: float, seed: int) -> tuple[Any, tuple[int, ...]]:
    """A pruned float32 layer keeping ``density`` of its weights (the inputs and gradients are float32
    too: a float64 layer would time a mixed-precision product) and its per-sample input shape."""
    if isinstance(spec, int):
        layer: Any = Linear(spec, spec, rng=seed, prune_pattern=True, dtype=np.float32)
        shape: tuple[int, ...] = (spec,)
    else:
        cin, cout, side = spec
        layer = Conv2d(cin, cout, 3, padding=1, rng=seed, prune_pattern=True, dtype=np.float32)
        shape = (cin, side, side)
    weight = layer.weight.copy()
    weight.ravel()[np.random.default_rng(seed).random(weight.size) >= density] = 0
    layer.weight = weight
    return layer, shape


def timers(layer: Any, x: Any, grad: Any, be: backend.Backend) -> dict[str, Callable[[], Any]]:
    timed = {"forward": lambda: layer.forward(x),
             "weight_gradient": lambda: layer.parameter_gradients(x, grad)}
    if isinstance(layer, Conv2d):
        matvec_grad = grad.reshape(grad.shape[0], -1)
        timed["input_gradient"] = lambda: layer.weights_matvec(x.shape[1:], be.name)(matvec_grad)
    return timed


def measure(spec: Any, density: float, batch: int, repeats: int, be: backend.Backend,
            paths: Paths) -> dict[str, Any]:
    layer, shape = layer_for(spec, density, seed=batch)
    rng = np.random.default_rng(0)
    x = be.asarray(rng.standard_normal((batch, *shape)).astype(np.float32))
    grad = be.asarray(rng.standard_normal((batch, *layer.output_shape(shape))).astype(np.float32))
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(repeats + 1):  # the first round warms up (compiles, plans)
        for sparse in (True, False):
            paths.use(sparse)
            for name, fn in timers(layer, x, grad, be).items():
                be.synchronize()
                start = time.perf_counter()
                fn()
                be.synchronize()
                times.setdefault(name, {}).setdefault("sparse" if sparse else "dense", []).append(
                    time.perf_counter() - start)
    paths.restore()
    row: dict[str, Any] = {"layer": "linear" if isinstance(spec, int) else "conv", "shape": spec,
                           "density": density, "kept": int(np.count_nonzero(layer.weight)), "batch": batch}
    for name, both in times.items():
        sparse_s, dense_s = (statistics.median(both[kind][1:]) for kind in ("sparse", "dense"))
        row[name] = {"sparse_s": sparse_s, "dense_s": dense_s, "dense_over_sparse": dense_s / sparse_s}
    return row


def crossovers(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per operation, the largest density at which the sparse path won on every layer and batch (None:
    it lost already at the lowest)."""
    found: dict[str, float | None] = {}
    densities = sorted({row["density"] for row in rows})
    for name in OPERATIONS:
        best = None
        for density in densities:
            measured = [row[name]["dense_over_sparse"] for row in rows
                        if row["density"] == density and name in row]
            if measured and min(measured) >= 1.0:
                best = density
            elif measured:
                break
        found[name] = best
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--densities", default="0.01,0.03,0.1,0.2,0.3,0.5")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--quick", action="store_true",
                        help="VGG-11's conv2, conv6 and the Linear layer only")
    args = parser.parse_args()
    be = backend.get(args.device)
    specs: list[Any] = [VGG11[1], VGG11[5], 512] if args.quick else [*VGG11, 512]
    paths = Paths()
    rows = []
    for density in (float(d) for d in args.densities.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            for spec in specs:
                rows.append(measure(spec, density, batch, args.repeats, be, paths))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "pruned products: sparse against dense per layer and density",
                      "machine": machine(be, with_torch=False), "cpu_pressure": cpu_pressure(),
                      "constants": {name: getattr(pruned_module, name) for name in (
                          "DIRECT_MAX_DENSITY", "LINEAR_DIRECT_MAX_DENSITY", "SAMPLED_MAX_DENSITY",
                          "TRANSPOSED_MAX_DENSITY")},
                      "crossovers": crossovers(rows), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
