"""Paper Table 1, last column: analytic transposed-Jacobian generation versus PyTorch autograd.

On VGG-11's first conv (3->64, 3x3, pad 1), ReLU and 2x2 max-pool over a 3x32x32 input, one run
measures, side by side on the same layers:

* the analytic generation: pattern build (once per architecture, cached) and values fill (paid every
  iteration) separately, medians of repeats;
* PyTorch autograd one column at a time (the paper's baseline: one backward per output element), on
  a sample of columns extrapolated to all of them unless ``--autograd-columns all``; the columns
  measured are also checked against the engine's JT;
* ``torch.func.vmap`` over VJPs in chunks (what ``jacrev`` computes), and ``torch.func.jacrev``
  itself where the dense Jacobian and its ``n_out x n_out`` basis fit in ``--jacrev-limit-gib``;
* memory-copy bandwidth for the bytes the values fill writes (same size, and a large DRAM-bound copy).

Prints JSON (``--json``) or a table. Timings on shared machines are noisy: compare the ratios of one
run, never lone absolute times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import numpy as np
from common import machine, median_time

from sparse_scan import backend
from sparse_scan.flops import layer_stats
from sparse_scan.layers import Conv2d, MaxPool2d, ReLU

PAPER_RATIOS = {"conv1": 8.3e3, "relu1": 1.2e6, "pool1": 1.5e5}
PAPER_AUTOGRAD_S_HERE = {"conv1": 5.4, "relu1": 3.3, "pool1": 1.1}


def vgg11_head() -> list[tuple[str, Any, tuple[int, ...]]]:
    """(name, layer, per-sample input shape) of VGG-11's first conv, ReLU and max-pool."""
    return [
        ("conv1", Conv2d(3, 64, 3, padding=1, rng=0), (3, 32, 32)),
        ("relu1", ReLU(), (64, 32, 32)),
        ("pool1", MaxPool2d(2, 2), (64, 32, 32)),
    ]


def copy_bandwidth(be: backend.Backend, nbytes: int, repeats: int, sync: Callable[[], None]) -> float:
    """Bytes written per second by a plain array copy of ``nbytes``."""
    src = be.xp.ones(max(1, nbytes // 4), dtype=np.float32)
    dst = be.xp.empty_like(src)
    return src.nbytes / median_time(lambda: be.xp.copyto(dst, src), repeats, sync)


def torch_module(name: str, layer: Any, device: str):
    import torch

    if name == "conv1":
        module = torch.nn.Conv2d(3, 64, 3, padding=1)
        module.weight.data = torch.from_numpy(layer.weight.copy())
        module.bias.data = torch.from_numpy(layer.bias.copy())
    elif name == "relu1":
        module = torch.nn.ReLU()
    else:
        module = torch.nn.MaxPool2d(2, 2)
    return module.to(device)


def autograd_columns(module, x_np: np.ndarray, columns: np.ndarray, device: str,
                     sync: Callable[[], None]) -> tuple[float, np.ndarray]:
    """Seconds for the paper's baseline on ``columns`` (one backward each), and those JT columns.

    Each backward writes its JT column (a gradient w.r.t. the input) into a row of the result, so
    the baseline, like the analytic generation, ends with the Jacobian stored.
    """
    import torch

    x = torch.from_numpy(x_np).to(device).requires_grad_(True)
    y = module(x)
    seed = torch.zeros_like(y)
    flat_seed = seed.view(-1)
    out = torch.empty((len(columns), x_np.size), dtype=y.dtype, device=y.device)
    sync()
    start = time.perf_counter()
    for k, j in enumerate(columns.tolist()):
        flat_seed[j] = 1
        (grad,) = torch.autograd.grad(y, x, seed, retain_graph=True)
        flat_seed[j] = 0
        out[k] = grad.view(-1)
    sync()
    return time.perf_counter() - start, out.cpu().numpy().T


def jacrev_time(module, x_np: np.ndarray, device: str, repeats: int, chunk_size: int,
                sync: Callable[[], None]) -> float:
    """Median seconds of ``torch.func.jacrev`` (vmapped VJPs, ``chunk_size`` columns at a time)."""
    import torch

    x = torch.from_numpy(x_np).to(device)
    jac = torch.func.jacrev(module, chunk_size=chunk_size)
    return median_time(lambda: jac(x), repeats, sync)


def vmap_vjp_time(module, x_np: np.ndarray, device: str, chunk_size: int,
                  sync: Callable[[], None]) -> float:
    """Seconds for every JT column by ``torch.func.vmap`` over VJPs, one-hot seeds built per chunk.

    This is what ``jacrev`` computes, without its full ``n_out x n_out`` basis in memory.
    """
    import torch

    x = torch.from_numpy(x_np).to(device)
    y, vjp = torch.func.vjp(module, x)
    batched = torch.func.vmap(vjp)
    n_out = y.numel()
    sync()
    start = time.perf_counter()
    for first in range(0, n_out, chunk_size):
        count = min(chunk_size, n_out - first)
        seeds = torch.zeros((count, n_out), dtype=y.dtype, device=y.device)
        seeds[torch.arange(count), torch.arange(first, first + count)] = 1
        batched(seeds.reshape((count,) + tuple(y.shape)))
    sync()
    return time.perf_counter() - start


def measure_layer(name: str, layer: Any, in_shape: tuple[int, ...], args: argparse.Namespace,
                  be: backend.Backend, sync: Callable[[], None], batch: int,
                  baselines: bool) -> dict[str, Any]:
    """Analytic figures for ``batch`` samples; with ``baselines``, the torch baselines too."""
    rng = np.random.default_rng(0)
    x_host = rng.standard_normal((batch,) + in_shape).astype(np.float32)
    x = be.asarray(x_host)
    row = layer_stats(layer, in_shape, np.float32, name=name)

    def build_pattern() -> None:
        layer._patterns.clear()  # measure a cold build every time
        layer.pattern(in_shape, device=be.name)

    row["pattern_s"] = median_time(build_pattern, args.repeats, sync)
    layer.pattern(in_shape, device=be.name)
    jt = layer.transposed_jacobian(x)
    row["values_s"] = median_time(lambda: layer.transposed_jacobian(x), args.repeats * 5, sync)
    row["values_bytes"] = jt.nbytes_values
    row["values_GBps"] = jt.nbytes_values / row["values_s"] / 1e9
    row["copy_GBps_same_size"] = copy_bandwidth(be, jt.nbytes_values, args.repeats * 5, sync) / 1e9
    row["fill_vs_copy"] = row["values_GBps"] / row["copy_GBps_same_size"]
    row["analytic_s"] = row["pattern_s"] + row["values_s"]

    if baselines and args.autograd_columns != "0":
        try:
            import torch  # noqa: F401
        except ImportError:
            row["autograd"] = "torch not installed"
            return row
        device = "cuda" if be.name == "gpu" else "cpu"
        module = torch_module(name, layer, device)
        n_out = row["shape"][1]
        count = n_out if args.autograd_columns == "all" else min(n_out, int(args.autograd_columns))
        columns = np.sort(rng.choice(n_out, size=count, replace=False))
        seconds, cols = autograd_columns(module, x_host[:1], columns, device, sync)
        expected = layer.transposed_jacobian(x_host[:1]).to_scipy(0)[:, columns].toarray()
        row["autograd_columns_agree"] = bool(np.allclose(cols, expected, rtol=1e-5, atol=1e-6))
        row["autograd_columns_measured"] = count
        row["autograd_column_s"] = seconds * n_out / count
        row["paper_autograd_s_on_this_machine"] = PAPER_AUTOGRAD_S_HERE[name]
        row["ratio_vs_autograd_total"] = row["autograd_column_s"] / row["analytic_s"]
        row["ratio_vs_autograd_values"] = row["autograd_column_s"] / row["values_s"]
        row["paper_ratio"] = PAPER_RATIOS[name]
        row["vmap_vjp_s"] = vmap_vjp_time(module, x_host[:1], device, args.jacrev_chunk, sync)
        row["ratio_vs_vmap_vjp_total"] = row["vmap_vjp_s"] / row["analytic_s"]
        # jacrev materialises the dense Jacobian and, whatever its chunk size, an n_out x n_out basis
        jacrev_bytes = row["dense_bytes"] + n_out * n_out * 4
        if jacrev_bytes <= args.jacrev_limit_gib * 2**30:
            row["jacrev_s"] = jacrev_time(module, x_host[:1], device, max(1, args.repeats // 2),
                                          args.jacrev_chunk, sync)
            row["ratio_vs_jacrev_total"] = row["jacrev_s"] / row["analytic_s"]
        else:
            row["jacrev_s"] = None
            row["jacrev_skipped"] = f"needs {jacrev_bytes / 2**30:.1f} GiB (limit {args.jacrev_limit_gib})"
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "gpu", "auto"), default="cpu")
    parser.add_argument("--batch", default="1,16",
                        help="comma-separated batch sizes of the values fill (paper: 1); the "
                             "torch baselines run at the first")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--autograd-columns", default="4096",
                        help="columns timed with autograd and extrapolated; 'all' or '0' (skip)")
    parser.add_argument("--jacrev-limit-gib", type=float, default=4.0,
                        help="skip jacrev where the dense Jacobian plus its basis is larger")
    parser.add_argument("--jacrev-chunk", type=int, default=1024,
                        help="columns per vmapped chunk (bounds jacrev's working memory)")
    parser.add_argument("--quick", action="store_true",
                        help="figures and analytic timings only (no autograd baseline)")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    if args.quick:
        args.autograd_columns, args.repeats, args.batch = "0", 3, "1"
    return args


def print_table(result: dict[str, Any]) -> None:
    print(f"{'layer':7} {'batch':>5} {'JT shape':>16} {'nnz':>9} {'sparsity':>8} {'CSR MiB':>8} "
          f"{'dense MiB':>9} {'pattern ms':>10} {'values ms':>9} {'fill/copy':>9} {'vs autograd':>11} "
          f"{'paper':>7}")
    for r in (dict(row, batch=run["batch"]) for run in result["runs"] for row in run["layers"]):
        ratio = r.get("ratio_vs_autograd_total")
        ours = f"{ratio:.2e}x" if ratio else "-"
        paper = f"{r['paper_ratio']:.1e}x" if "paper_ratio" in r else "-"
        print(f"{r['name']:7} {r['batch']:>5} {str(tuple(r['shape'])):>16} {r['nnz']:>9} "
              f"{r['sparsity']:>8.5f} "
              f"{r['csr_bytes'] / 2**20:>8.2f} {r['dense_bytes'] / 2**20:>9.0f} "
              f"{r['pattern_s'] * 1e3:>10.2f} {r['values_s'] * 1e3:>9.3f} {r['fill_vs_copy']:>9.2f} "
              f"{ours:>11} {paper:>7}")
    print(f"large-copy bandwidth: {result['copy_GBps_large']:.1f} GB/s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    be = backend.get(args.device)
    if be.name == "gpu":
        import torch  # noqa: F401 - the baseline shares the device

        def sync() -> None:
            be.xp.cuda.Device().synchronize()
            if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
                sys.modules["torch"].cuda.synchronize()
    else:
        def sync() -> None:
            return None

    batches = [int(b) for b in str(args.batch).split(",")]
    layers = vgg11_head()
    runs = [{"batch": batch,
             "layers": [measure_layer(name, layer, shape, args, be, sync, batch, first)
                        for name, layer, shape in layers]}
            for batch, first in zip(batches, [True] + [False] * (len(batches) - 1), strict=True)]
    result = {
        "benchmark": "jacobians",
        "machine": machine(be),
        "copy_GBps_large": copy_bandwidth(be, 512 * 2**20, 5, sync) / 1e9,
        "runs": runs,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
