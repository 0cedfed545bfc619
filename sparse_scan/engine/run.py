"""The engine's one CPU/GPU dispatch: plans in, gradients out, on the arrays' own device.

Every executor has a host twin (:mod:`._cpu`, :mod:`._dense_cpu`: NumPy, SciPy and numba kernels) and
a GPU twin (:mod:`._gpu`, :mod:`._dense_gpu`: CuPy RawKernels); each operation below picks one through
:func:`sparse_scan.backend.twin`, from the backend its caller names or the one that owns its arrays.
Nothing else in the library chooses between them, and nothing here plans: plans come from
:mod:`sparse_scan.engine.plan` and :mod:`sparse_scan.engine.dense_plan`.

Examples
--------
>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> blocks = rng.standard_normal((5, 2, 3, 3)) / 3     # T=5 steps, batch 2, H=3: A_1 .. A_5
>>> direct = rng.standard_normal((5, 2, 3))           # d_1 .. d_5
>>> scan = dense_scan(blocks, direct, method="blelloch")
>>> bp = dense_scan(blocks, direct, method="linear")
>>> scan.shape, bool(np.allclose(scan, bp))           # G_0 .. G_5
((6, 2, 3), True)
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from .. import backend as _backend
from .._types import Array
from ..csr import BatchedCSR
from . import _cpu, _dense_cpu, _dense_gpu, _gpu
from .dense_plan import auto_levels, build_dense_plan
from .plan import ScanPlan
from .products import ProductPlan

__all__ = ["dense_scan", "multiply", "run_plan", "through_inputs", "through_weights"]

_run_plan = _backend.twin(
    cpu=lambda be, plan, grad_out, jacobians, threads, weights_matvecs, outputs, ready: _cpu.run_plan(
        plan, grad_out, jacobians, threads=threads, weights_matvecs=weights_matvecs, outputs=outputs,
        ready=ready),
    # the GPU runs a level as one launch, every step of it: the gradients not wanted are dropped, and
    # the launches are asynchronous (nothing to start beside them)
    gpu=lambda be, plan, grad_out, jacobians, threads, weights_matvecs, outputs, ready: [
        grad if outputs is None or i in outputs else None
        for i, grad in enumerate(_gpu.run_plan(plan, grad_out, jacobians))])
# the GPU scan runs every mv as an SpMV in its level launch: no JT goes through its layer's weights
_through_weights = _backend.twin(cpu=lambda be, plan, batch: plan.weights.through(batch),
                                 gpu=lambda be, plan, batch: frozenset())
_multiply = _backend.twin(cpu=lambda be, plan, a_data, b_data: _cpu.multiply(plan, a_data, b_data),
                          gpu=lambda be, plan, a_data, b_data: _gpu.multiply(plan, a_data, b_data))
_run_dense_plan = _backend.twin(
    cpu=lambda be, plan, blocks, direct, threads: _dense_cpu.run_dense_plan(plan, blocks, direct, threads),
    gpu=lambda be, plan, blocks, direct, threads: _dense_gpu.run_dense_plan(plan, blocks, direct))


def through_weights(be: _backend.Backend, plan: ScanPlan, batch: int) -> frozenset[int]:
    """The layer JTs (scan elements ``j``) whose mv steps a run of ``plan`` for ``batch`` samples on
    ``be`` applies through their layers' weights (``Layer.weights_matvec``) instead of their values:
    ``plan.weights.through(batch)`` on the CPU (:mod:`sparse_scan.engine._weights_path`), none on the
    GPU. ``plan.weights.valueless`` of them need no values at all."""
    return _through_weights(be, plan, batch)


def through_inputs(plan: ScanPlan) -> frozenset[int]:
    """The layer JTs (scan elements ``j``) whose mv steps a run of ``plan`` may apply by their layers'
    operators from the input (``Layer.input_matvec``: ReLU, 2x2 max-pool) instead of their values:
    every JT that only mv steps read (``plan.weights.mv_only``); the run then fills no values for
    those whose layer offers an operator. Whether one exists on a backend is the layer's to say (its
    operator twin): the host's are compiled kernels, and on the GPU no layer offers one, so the GPU
    scan fills every JT."""
    return plan.weights.mv_only


def run_plan(be: _backend.Backend, plan: ScanPlan, grad_out: Array, jacobians: Sequence[BatchedCSR | None],
             threads: int | None = None,
             weights_matvecs: Mapping[int, Callable[[Array], Array]] | None = None,
             outputs: frozenset[int] | None = None,
             ready: Callable[[int, Array], None] | None = None) -> list[Array | None]:
    """Numeric phase of ``plan`` for one batch on ``be``.

    Parameters
    ----------
    be : Backend
        Where the values live (:func:`sparse_scan.backend.get`).
    plan : ScanPlan
        Built by :func:`~sparse_scan.engine.plan.build_plan` (an estimate has nothing to run).
    grad_out : ndarray, shape (B, size of x_n)
        ``g_n``, flattened per sample.
    jacobians : sequence of BatchedCSR or None
        ``jacobians[j - 1]`` is scan element ``j`` (the JT of layer ``n - j + 1``), with the patterns
        the plan was built from; None for those of :func:`through_weights` that the plan's
        ``weights.valueless`` names.
    threads : int, optional
        CPU worker threads per level (default: the cores this process may use); the GPU runs a level
        as one launch.
    weights_matvecs : mapping, optional
        CPU only: ``weights_matvecs[j](g)`` computes ``JT_j @ g`` from the layer's weights
        (``Layer.weights_matvec``) for the JTs of :func:`through_weights`, or from its input
        (``Layer.input_matvec``) for those of :func:`through_inputs` it offers one for; every mv step
        by such a JT uses it.
    outputs : frozenset of int, optional
        The gradients wanted (``i`` of ``x_i``; None: every one). The CPU runs only the steps they need
        (:meth:`~sparse_scan.engine.plan.ScanPlan.needed_steps`; ``jacobians`` may then hold None for
        the values none of those reads); the GPU runs every step of a level in one launch.
    ready : callable, optional
        CPU only: ``ready(i, grad)`` on the calling thread as soon as the wanted gradient w.r.t.
        ``x_i`` is computed, for work that may start from it while the scan goes on.

    Returns
    -------
    list of ndarray
        ``grads[i]`` of shape ``(B, size of x_i)``, ``i = 0..n``, on ``be``; None for one not in
        ``outputs``.
    """
    return _run_plan(be, plan, grad_out, jacobians, threads, weights_matvecs, outputs, ready)


def multiply(plan: ProductPlan, a_data: Array, b_data: Array) -> Array:
    """Numeric phase of ``C = A @ B``: values of ``C`` in ``plan.out``'s entry order.

    ``a_data``/``b_data`` are ``(nnz,)`` (shared by the batch) or ``(B, nnz)``, both NumPy or both
    CuPy arrays (a diagonal operand's data holds its diagonal); the result is ``(nnz_C,)`` when both
    are shared, else ``(B, nnz_C)``, on their device.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from sparse_scan.csr import Pattern
    >>> from sparse_scan.engine.products import plan_product
    >>> a = sp.random(5, 4, density=0.5, format="csr", random_state=0)
    >>> b = sp.random(4, 3, density=0.5, format="csr", random_state=1)
    >>> plan = plan_product(Pattern(a.indptr, a.indices, a.shape), Pattern(b.indptr, b.indices, b.shape),
    ...                     "general", "general")
    >>> c = multiply(plan, a.data, b.data)
    >>> bool(np.allclose(sp.csr_matrix((c, plan.out.indices, plan.out.indptr), plan.out.shape).toarray(),
    ...                  (a @ b).toarray()))
    True
    """
    be = _backend.of(a_data)
    if _backend.of(b_data).name != be.name:
        raise ValueError("multiply: a_data and b_data must both be NumPy or both CuPy arrays")
    for name, data, pattern in zip(("a_data", "b_data"), (a_data, b_data), plan.operands or (), strict=False):
        if data.shape[-1] != pattern.nnz:  # the compiled kernels do not check their reads
            raise ValueError(f"multiply: {name} holds {data.shape[-1]} values per sample; the plan's "
                             f"operand has {pattern.nnz} entries")
    return _multiply(be, plan, a_data, b_data)


def dense_scan(blocks: Array, direct: Array, method: str = "blelloch", levels: int | str | None = None,
               threads: int | None = None) -> Array:
    """Total gradients of a recurrent chain by a scan over dense blocks.

    Parameters
    ----------
    blocks : ndarray, shape (T, B, H, H)
        ``blocks[t - 1]`` is ``(dh_t/dh_{t-1})^T`` per sample (time-major), NumPy or CuPy.
    direct : ndarray, shape (T, B, H) or (B, H)
        ``direct[t - 1]`` is the loss's direct gradient w.r.t. ``h_t``; a ``(B, H)`` array is the
        gradient w.r.t. ``h_T`` alone (a loss on the last hidden state, as in the paper), which
        makes the scan a chain of plain block products (no vector parts).
    method : {"linear", "blelloch", "hybrid"}
    levels : int or "auto", optional
        Up-sweep levels of ``hybrid``; ``"auto"`` picks them with :func:`auto_levels`.
    threads : int, optional
        CPU threads that share each level's block products (default: the cores available).

    Returns
    -------
    ndarray, shape (T + 1, B, H)
        ``out[t]`` is the total gradient w.r.t. ``h_t`` (``out[0]``: w.r.t. the initial state).
    """
    be = _backend.of(blocks)
    n, batch = blocks.shape[:2]
    if blocks.ndim != 4 or blocks.shape[2] != blocks.shape[3] or \
            direct.shape not in ((n, batch, blocks.shape[2]), (batch, blocks.shape[2])):
        raise ValueError(f"blocks must be (T, B, H, H) and direct (T, B, H) or (B, H); got "
                         f"{blocks.shape} and {direct.shape}")
    size = blocks.shape[2]
    if levels == "auto":
        method, levels = "hybrid", auto_levels(n, batch, size, be.name)
    plan = build_dense_plan(n, method, levels)
    return _run_dense_plan(be, plan, blocks, be.xp.asarray(direct, dtype=blocks.dtype), threads)
