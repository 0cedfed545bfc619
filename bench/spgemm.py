"""Numeric SpGEMM with a precomputed plan versus SciPy ``A @ B``, on VGG-11's up-sweep products.

For the Blelloch scan over VGG-11's conv stack (3x32x32), dense and 97%-magnitude-pruned, every
matrix-matrix product of up-sweep levels 0 and 1 is timed three ways in one run:

* the engine's numeric phase with the product's plan (batch 1, and batch 16 per sample);
* SciPy ``A @ B`` on the same operands, one sample at a time (it also redoes the symbolic work and
  drops zeros, so it is the oracle and the baseline, not a substitute);
* the plan build (symbolic, once per architecture) against one SciPy product.

With ``--device gpu`` the numeric phase runs on the GPU (``spgemm.multiply`` on CuPy operands: one
RawKernel launch, or batched GEMMs for block products) against cupyx ``A @ B`` (cuSPARSE SpGEMM), one
sample at a time, both timed to the end of their device work. The numeric results are checked against
SciPy's (or cupyx's). Products over ``--max-multiply-adds`` (per sample) are listed with their figures
but not run. Prints JSON (``--json``) or a table; ``--rows FILE`` also appends each row to FILE as one
JSON line the moment it is done (``common.Rows``: a run killed half-way keeps what it finished).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any, Callable

import numpy as np
import scipy.sparse as sp
from common import Rows, machine, median_time
from vgg import vgg11_features

from sparse_scan import backend
from sparse_scan.engine._blocks import block_layout
from sparse_scan.engine.products import count_multiply_adds, plan_product
from sparse_scan.engine.run import multiply
from sparse_scan.engine.schedule import Element, schedule


def scipy_matrix(pattern, data, sample: int, be: backend.Backend):
    """Sample ``sample`` of a batched CSR as a SciPy matrix (cupyx on the GPU)."""
    values = data if data.ndim == 1 else data[sample]
    if be.name == "gpu":
        import cupyx.scipy.sparse as gpu_sparse  # noqa: PLC0415 - GPU runs only

        return gpu_sparse.csr_matrix((be.asarray(values), be.asarray(pattern.indices),
                                      be.asarray(pattern.indptr)), shape=pattern.shape)
    return sp.csr_matrix((values, pattern.indices, pattern.indptr), shape=pattern.shape)


def median_time_of(fn: Callable[..., Any], args: tuple, repeats: int, be: backend.Backend) -> float:
    return median_time(lambda: fn(*args), repeats, be.synchronize)


def scipy_products(pairs: list) -> list:
    return [a @ b for a, b in pairs]


def measure(args: argparse.Namespace, prune: float, log: Rows) -> list[dict[str, Any]]:
    be = backend.get(args.device)
    baseline = "cupyx" if be.name == "gpu" else "scipy"
    rows = []
    rng = np.random.default_rng(0)
    for batch in (1, args.batch):
        model = vgg11_features(pruned=prune > 0)
        x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
        model.forward(x)
        n = len(model)
        shapes = model.shapes(x.shape[1:])
        jts = model.transposed_jacobians()
        values: dict[Element, Any] = {}
        for j in range(1, n + 1):
            values[Element(j, j)] = (jts[n - j].pattern, model.layers[n - j].jacobian_kind,
                                     jts[n - j].data)
        for level, phase, left, right, _ in schedule(n, "blelloch", None):
            if phase != "up" or level > 1 or left.lo == 0:
                continue
            out = Element(left.lo, right.hi)
            row: dict[str, Any] = {"model": f"vgg11-pruned{int(prune * 100)}" if prune else "vgg11",
                                   "batch": batch, "level": level,
                                   "layers": [model.layers[n - right.hi].name,
                                              model.layers[n - left.lo].name]}
            rows.append(row)
            try:
                if values.get(left) is None or values.get(right) is None:
                    row["skipped"] = "an operand was not computed"
                    values[out] = None
                    continue
                (a_pat, a_kind, a_data), (b_pat, b_kind, b_data) = values[right], values[left]
                multiply_adds = count_multiply_adds(a_pat, b_pat)
                row.update(mnk=[a_pat.shape[0], a_pat.shape[1], b_pat.shape[1]], multiply_adds=multiply_adds)
                channels = (shapes[n - right.hi][0], shapes[n - left.hi][0], shapes[n - left.lo + 1][0])
                dense_blocks = (block_layout(a_pat, *channels[:2]) is not None
                                and block_layout(b_pat, *channels[1:]) is not None)
                limit = args.max_multiply_adds if dense_blocks else args.max_scalar_multiply_adds
                if multiply_adds > limit:
                    row["skipped"] = f"{multiply_adds} multiply-adds per sample over the limit"
                    values[out] = None
                    continue
                start = time.perf_counter()
                plan = plan_product(a_pat, b_pat, a_kind, b_kind, channels=channels)
                row["plan_s"] = time.perf_counter() - start
                row.update(method=plan.method, flops=plan.flops, flops_live=plan.flops_live,
                           out_nnz=plan.out.nnz, plan_bytes=plan.nbytes,
                           shared_operands=a_data.ndim == 1 and b_data.ndim == 1)
                result = multiply(plan, a_data, b_data)
                values[out] = (plan.out, "general", result)
                operands = (plan, be.asarray(a_data), be.asarray(b_data))
                row["ours_s"] = median_time_of(multiply, operands, args.repeats, be)
                if be.name == "gpu":
                    on_device = be.to_host(multiply(*operands))
                    row["max_rel_error_gpu_vs_cpu"] = float(abs(on_device - result).max()) / max(
                        float(abs(result).max(initial=0.0)), 1e-30)
                samples = 1 if row["shared_operands"] else batch
                if multiply_adds > args.max_scipy_multiply_adds:
                    row[f"{baseline}_skipped"] = "over --max-scipy-multiply-adds"
                    continue
                pairs = [(scipy_matrix(a_pat, a_data, s, be), scipy_matrix(b_pat, b_data, s, be))
                         for s in range(samples)]
                row[f"{baseline}_s"] = median_time_of(scipy_products, (pairs,), args.repeats, be)
                check = pairs[0][0] @ pairs[0][1]
                if be.name == "gpu":
                    check = check.get()
                ours = sp.csr_matrix((result if result.ndim == 1 else result[0], plan.out.indices,
                                      plan.out.indptr), shape=plan.out.shape)
                scale = float(abs(check).max()) if check.nnz else 1.0
                row[f"max_rel_error_vs_{baseline}"] = (float(abs(ours - check).max()) / scale
                                                       if check.nnz else 0.0)
                row[f"speedup_vs_{baseline}"] = row[f"{baseline}_s"] / row["ours_s"]
                row[f"plan_vs_one_{baseline}_product"] = row["plan_s"] / (row[f"{baseline}_s"] / samples)
                print(json.dumps(row), file=sys.stderr, flush=True)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {error}"
                raise
            finally:  # each row as soon as it is done, skipped or failed ones too
                log.add(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="the second batch size (per sample)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-multiply-adds", type=float, default=2e10,
                        help="products above this (per sample) are listed but not planned or run")
    parser.add_argument("--max-scalar-multiply-adds", type=float, default=5e7,
                        help="the same limit for products without dense blocks (scalar plans)")
    parser.add_argument("--max-scipy-multiply-adds", type=float, default=4e8,
                        help="SciPy is not timed on products above this (per sample)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: our numeric phase on CuPy operands against cupyx (cuSPARSE)")
    parser.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                        help="also the unpruned network")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rows", type=pathlib.Path, metavar="FILE",
                        help="append each row to FILE as one JSON line as soon as it is done")
    args = parser.parse_args(argv)
    log = Rows(args.rows, "spgemm", machine(backend.get(args.device), with_torch=False))
    rows = measure(args, 0.97, log) + (measure(args, 0.0, log) if args.dense else [])
    log.finish()
    if args.json:
        print(json.dumps({"benchmark": "spgemm", "machine": machine(backend.get(args.device)), "rows": rows},
                         indent=2))
        return 0
    name = "cupyx" if args.device == "gpu" else "scipy"
    for r in rows:
        print(f"{r['model']:15} B={r['batch']:<3} L{r['level']} {r['layers'][0]:>3}..{r['layers'][1]:<3} "
              f"{r.get('method', '-'):13} madds={r.get('multiply_adds', 0):>12} "
              + (f"ours={r['ours_s'] * 1e3:9.2f} ms {name}={r[f'{name}_s'] * 1e3:9.2f} ms "
                 f"x{r[f'speedup_vs_{name}']:.1f} plan/{name}={r[f'plan_vs_one_{name}_product']:.1f}"
                 if f"{name}_s" in r else f"ours={r['ours_s'] * 1e3:9.2f} ms (no {name})"
                 if "ours_s" in r else r.get("skipped", "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
