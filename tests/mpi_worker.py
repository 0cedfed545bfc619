"""Run by the distributed tests under ``mpirun -n P``: a distributed backward pass, written by rank 0.

``python tests/mpi_worker.py MODEL OUT.npz [--combine C] [--method M] [--split 1,2,3]
[--fail-rank R] [--hang-rank R] [--timeout S] [--device gpu] [--transport T]``: ``MODEL`` is a spec
path, ``random:SEED`` (:func:`random_chain`), ``mlp:SEED`` (:func:`random_mlp`) or ``rnn:SEED``
(:func:`random_rnn`). Rank 0 writes ``grad.<i>`` (w.r.t. ``x_i``), ``param.<name>``, ``sent_bytes``,
``products`` (each rank's slice product non-zeros, -1 for none) and, with ``--device gpu``,
``transport_sent``/``transport_received`` (each rank's device bytes moved by the transport) and
``transport`` (its name) to ``OUT.npz``, gradients on the host. With ``--device gpu`` run it as
``python -m cupy_standin tests/mpi_worker.py ...`` where no GPU is usable: every rank on the CuPy
stand-in. ``--fail-rank`` makes that rank's first layer raise, ``--hang-rank`` makes
it sleep; a :class:`~sparse_scan.distributed.DistributedError` is printed, and a timeout ends every
rank (:func:`sparse_scan.distributed.abort`). With ``--hang-rank`` every rank first runs the whole
forward pass once (its kernels loaded) and then waits at a barrier, so that the ranks start the
timed pass together: the rank waiting on the stuck one times out first, whatever the machine's
speed (a rank still starting up would otherwise look stuck to its neighbours).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import sparse_scan
from sparse_scan import Sequential, backend
from sparse_scan.layers import Conv2d, Flatten, LeakyReLU, Linear, MaxPool2d, ReLU, Sigmoid, Tanh

BATCH = 3


def random_chain(seed: int) -> Sequential:
    """A seeded random chain: convolutions, activations and pools, then linear layers (float64)."""
    rng = np.random.default_rng(seed)
    channels, size = int(rng.integers(1, 3)), 8
    layers: list = []
    for _ in range(int(rng.integers(1, 3))):
        out = int(rng.integers(2, 4))
        layers += [Conv2d(channels, out, 3, padding=1, dtype=np.float64, rng=len(layers)),
                   [ReLU, Tanh, Sigmoid, LeakyReLU][int(rng.integers(4))]()]
        if rng.random() < 0.6:
            layers.append(MaxPool2d(2))
            size //= 2
        channels = out
    features = channels * size * size
    layers.append(Flatten())
    for _ in range(int(rng.integers(1, 4))):
        out = int(rng.integers(3, 9))
        layers += [Linear(features, out, dtype=np.float64, rng=len(layers)), Tanh()]
        features = out
    return Sequential(*layers, input_shape=(int(layers[0].in_channels), 8, 8))


def random_mlp(seed: int) -> Sequential:
    """A seeded random multi-layer perceptron (float64): its slice products stay small and pay."""
    rng = np.random.default_rng(seed)
    widths = rng.integers(4, 10, 6).tolist()
    layers: list = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:], strict=True):
        layers += [Linear(fan_in, fan_out, dtype=np.float64, rng=len(layers)),
                   [Tanh, Sigmoid, LeakyReLU][int(rng.integers(3))]()]
    return Sequential(*layers, input_shape=(widths[0],))


def random_rnn(seed: int, steps: int = 6, hidden: int = 5) -> Sequential:
    """A small Elman RNN unrolled over ``steps`` (float64): ``h_t = tanh(W h_{t-1} + b)``, the same
    ``W`` and ``b`` at every step (each step's Linear seeded alike): the chain of dense ``H×H`` JTs
    that the scaling model's RNN stands for."""
    layers: list = []
    for _ in range(steps):
        layers += [Linear(hidden, hidden, dtype=np.float64, rng=seed), Tanh()]
    return Sequential(*layers, input_shape=(hidden,))


MODELS = {"random": random_chain, "mlp": random_mlp, "rnn": random_rnn}


def load(model: str) -> Sequential:
    """A spec path (float64), or ``KIND:SEED`` of :data:`MODELS` (``random``, ``mlp``, ``rnn``)."""
    kind, _, seed = model.partition(":")
    if kind in MODELS:
        return MODELS[kind](int(seed))
    return sparse_scan.load_model(model, dtype=np.float64)


def inputs(model: Sequential) -> tuple[np.ndarray, np.ndarray]:
    """The seeded batch and output gradient every test uses."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((BATCH,) + model.input_shape)
    out_shape = model.shapes(model.input_shape)[-1]
    return x, rng.standard_normal((BATCH,) + tuple(out_shape))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--combine", default="chain")
    parser.add_argument("--method", default="blelloch")
    parser.add_argument("--split")
    parser.add_argument("--fail-rank", type=int)
    parser.add_argument("--hang-rank", type=int)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transport", default="auto")
    args = parser.parse_args()
    from mpi4py import MPI

    from sparse_scan import distributed

    comm = MPI.COMM_WORLD
    model = load(args.model)
    x, grad = inputs(model)
    split = None if args.split is None else [int(c) for c in args.split.split(",")]
    if args.hang_rank is not None:
        # warm: the timed pass below runs no first-call compilation or loading
        model.forward(backend.get(args.device).asarray(x))
        comm.Barrier()
    if comm.rank in (args.fail_rank, args.hang_rank):
        first = distributed.slices(model, comm.size, split, model.input_shape)[comm.rank][0]
        layer = model.layers[first]

        def broken(batch: np.ndarray) -> np.ndarray:
            if comm.rank == args.hang_rank:
                time.sleep(600)
            raise RuntimeError(f"layer {layer.name} broke on purpose")

        layer.forward = broken
    try:
        result = distributed.backward(model, x if comm.rank == 0 else None, grad if comm.rank == 0 else None,
                                      comm, split, args.method, combine=args.combine, timeout=args.timeout,
                                      device=args.device, transport=args.transport)
    except distributed.DistributedError as error:
        print(f"rank {comm.rank}: {error}", file=sys.stderr, flush=True)
        if isinstance(error, distributed.RankTimeoutError) or getattr(error, "timed_out", False):
            distributed.abort(comm, 3)  # a stuck rank would never exit: end them all
        raise SystemExit(3) from None
    if comm.rank == 0:
        host = backend.get("cpu").asarray
        arrays = {f"grad.{i}": host(g) for i, g in enumerate(result.grads)}
        arrays.update({f"param.{name}": host(g) for name, g in result.parameters.items()})
        ranks = result.stats["ranks"]
        arrays["sent_bytes"] = np.array([stats["sent_bytes"] for stats in ranks])
        arrays["products"] = np.array([stats.get("product_nnz", -1) for stats in ranks])
        arrays["transport"] = np.array([stats["transport"] for stats in ranks])
        arrays["devices"] = np.array([stats["device"] for stats in ranks])
        arrays["transport_sent"] = np.array([stats.get("transport_sent_bytes", 0) for stats in ranks])
        arrays["transport_received"] = np.array([stats.get("transport_received_bytes", 0) for stats in ranks])
        np.savez(args.out, **arrays)


if __name__ == "__main__":
    main()
