"""One layer and one direction of a recurrent network: its forward over time, the Jacobian blocks of
its state chain and its backward through a scan.

A :class:`Cell` is the arithmetic of one cell kind over a whole sequence (stateless): ``forward_steps``
(the sequential forward, keeping what the Jacobians need), ``fill`` (every ``(ds_t/ds_{t-1})^T`` as a
dense ``S×S`` block, ``S`` the state size), ``chain`` (back-propagation with the blocks left in factored
form) and ``pre_activation_grads`` (the gradients of the gate pre-activations from the total gradients
w.r.t. the states), from which every input and parameter gradient is one GEMM or one sum over all
steps and samples. RNN and GRU blocks are ``Σ_k W_k^T diag(c_k) (+ diag(d))`` (:meth:`Cell.factors`),
the LSTM's state ``(h, c)`` has its own structure (:mod:`.lstm`).

A :class:`Run` is one layer and direction of a module: a cell, the names of its parameters in the
module and what its last forward kept; :meth:`Run.backward` scans the state chain with any schedule.

Back-propagation's schedule (``linear``, or a ``hybrid`` of depth 0) needs no block at all on the CPU:
the cell's compiled kernel (:meth:`Cell.back_propagate`) runs the whole backward of a run of samples,
the totals through the factored blocks, the input's and the parameters' gradients, so the ``T·B·S²``
block values are neither filled nor read. :func:`chain_through_factors` (and :meth:`Run.factored_chain`)
give the totals alone the same way, a GEMM over the samples per step. On a GPU that loop would be a few
launches per step; there the blocks are filled (a few launches over all steps) and the chain of ``T``
products is one launch (``dense_scan_chain``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import numpy as np

from .. import backend as _backend
from .._host_kernels import launch
from .._threads import cpu_threads, even_parts, run_parts, thread_count, worker_pool
from .._types import Array
from ..engine.dense_plan import auto_levels
from ..engine.run import dense_scan
from ._kernels import chain_factors, gradient_sums

__all__ = ["Cell", "Horizon", "Run", "cell_flops", "chain_through_factors", "compiled_back_propagation",
           "fill_blocks", "resolve_levels"]

CHUNK_BYTES = 2**20  # blocks filled per task on the CPU


def _fill_cpu(be: _backend.Backend, weights_t: Array, coefficients: Array, out: Array) -> None:
    # one pass over the output (NumPy's einsum loops beat broadcasting's H-long inner loops 2x, and
    # need contiguous weights to do so)
    np.einsum("kij,tbkj->tbij", np.ascontiguousarray(weights_t), coefficients, out=out,
              optimize=len(weights_t) > 1)


def _fill_gpu(be: _backend.Backend, weights_t: Array, coefficients: Array, out: Array) -> None:
    be.xp.multiply(weights_t[0], coefficients[:, :, 0, None, :], out=out)
    for k in range(1, len(weights_t)):
        out += weights_t[k] * coefficients[:, :, k, None, :]


_fill = _backend.twin(cpu=_fill_cpu, gpu=_fill_gpu)


def fill_blocks(weights_t: Array, coefficients: Array, out: Array) -> None:
    """``out[t, b] = Σ_k weights_t[k] · diag(coefficients[t, b, k])``: Jacobian blocks of a cell.

    Parameters
    ----------
    weights_t : ndarray, shape (K, R, C)
        Transposed recurrent weight matrices (square for RNN and GRU).
    coefficients : ndarray, shape (T, B, K, C)
        Per step and sample, the column scaling of each matrix.
    out : ndarray, shape (T, B, R, C)
        May be a view into larger blocks.
    """
    _fill(_backend.of(out), weights_t, coefficients, out)


def _chain_cpu(be: _backend.Backend, weights_t: Array, coefficients: Array, diagonal: Array | None,
               direct: Array) -> Array:
    """Compiled twin: each thread runs its samples through every step (one ``(K·H) × H`` product per
    step and sample, no call per step)."""
    steps, batch, terms, size = coefficients.shape
    dtype = coefficients.dtype
    stacked = np.ascontiguousarray(weights_t.transpose(0, 2, 1), dtype=dtype).reshape(terms * size, size)
    diagonal = np.empty((0, batch, size), dtype=dtype) if diagonal is None else \
        np.ascontiguousarray(diagonal, dtype=dtype)
    direct = np.ascontiguousarray(direct, dtype=dtype)
    totals = np.empty((steps + 1, batch, size), dtype=dtype)
    operands = (stacked, np.ascontiguousarray(coefficients), diagonal,
                direct if direct.ndim == 3 else direct[None], totals)
    launch(chain_factors, operands, even_parts(batch, cpu_threads()))
    return totals


def _chain_gpu(be: _backend.Backend, weights_t: Array, coefficients: Array, diagonal: Array | None,
               direct: Array) -> Array:
    """CuPy twin: one GEMM over the samples per step (the CUDA path of BP fills the blocks and runs
    the chain kernel instead; this serves direct calls)."""
    xp = be.xp
    steps, batch, terms, size = coefficients.shape
    stacked = xp.ascontiguousarray(weights_t.transpose(0, 2, 1)).reshape(terms * size, size)
    affine = direct.ndim == 3
    totals = xp.empty((steps + 1, batch, size), dtype=coefficients.dtype)
    totals[steps] = direct[steps - 1] if affine else direct
    scaled = xp.empty((batch, terms, size), dtype=coefficients.dtype)
    along_diagonal = xp.empty((batch, size), dtype=coefficients.dtype)
    for t in range(steps, 0, -1):
        xp.multiply(coefficients[t - 1], totals[t][:, None, :], out=scaled)
        xp.matmul(scaled.reshape(batch, terms * size), stacked, out=totals[t - 1])
        if diagonal is not None:
            totals[t - 1] += xp.multiply(diagonal[t - 1], totals[t], out=along_diagonal)
        if affine and t > 1:
            totals[t - 1] += direct[t - 2]
    return totals


_chain = _backend.twin(cpu=_chain_cpu, gpu=_chain_gpu)


def chain_through_factors(weights_t: Array, coefficients: Array, diagonal: Array | None,
                          direct: Array) -> Array:
    """Back-propagation through time with every block left in factored form.

    ``G_{t-1} = d_{t-1} + A_t G_t`` with ``A_t = Σ_k weights_t[k] diag(coefficients[t-1, :, k])
    (+ diag(diagonal[t-1]))``: per step and sample, ``(G_t ⊙ c_{t,k})_k`` stacked ``(K·H,)`` times
    the stacked ``W_k`` ``(K·H, H)``. The result equals :func:`~sparse_scan.engine.run.dense_scan` of
    the filled blocks with ``method="linear"``. On the CPU a compiled loop runs every step of a run of
    samples per thread (T=1000, B=16, H=20 on 2 cores: 3.7 ms as a NumPy GEMM per step, of which
    the calls were most); on a GPU one GEMM over the samples per step.

    Parameters
    ----------
    weights_t : ndarray, shape (K, H, H)
    coefficients : ndarray, shape (T, B, K, H)
    diagonal : ndarray, shape (T, B, H), or None
    direct : ndarray, shape (T, B, H) or (B, H)
        As in :func:`~sparse_scan.engine.run.dense_scan`.

    Returns
    -------
    ndarray, shape (T + 1, B, H)
        ``out[t]``: the total gradient w.r.t. ``h_t``, in the coefficients' dtype.
    """
    return _chain(_backend.of(coefficients), weights_t, coefficients, diagonal, direct)


def _bp_gradients_cpu(be: _backend.Backend, layer: Run, direct: Array,
                      threads: int | None) -> dict[str, Array]:
    """Compiled twin: the cell's kernel runs the whole backward (no block filled, no ``(T, B, ·)``
    temporary). T=1000, B=16, H=20 on 2 cores, medians of one shared-machine run: the RNN 3.5 ms as
    the chain kernel, gate gradients and two sums kernels, 2.5 ms as one; GRU 15.3 -> 5.4 ms; LSTM
    (its chain NumPy calls per step before) 56.9 -> 13.5 ms."""
    return layer.cell.back_propagate(layer.saved, layer.parameters_on(np), direct)


def _bp_gradients_gpu(be: _backend.Backend, layer: Run, direct: Array,
                      threads: int | None) -> dict[str, Array]:
    """CUDA twin: BP's totals (the blocks filled, the chain in one launch), then the gradients from
    them; every step runs (no ``horizon``)."""
    return layer.gradients(dense_scan(layer.transposed_jacobians(threads), direct, "linear")) | {
        "horizon": None}


_bp_gradients = _backend.twin(cpu=_bp_gradients_cpu, gpu=_bp_gradients_gpu)
"""Back-propagation's :meth:`Run.backward` before the parameters the run lacks are dropped."""


def _gradient_sums_cpu(be: _backend.Backend, a: Array, b: Array) -> tuple[Array, Array]:
    """Compiled twin: rows cut over the kernel pool's threads, each summing its rows in float64 (the
    sums run over ``T·B`` rows; NumPy took 0.7-1.1 ms for ``sum(axis=0)`` of ``(16000, 20)`` and
    1.0-1.5 ms for ``(20, 16000) @ (16000, 20)`` on 2 cores), the threads' partial sums added last."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    pieces = even_parts(len(a), cpu_threads()) or [(0, 0)]
    products, sums = np.empty((len(pieces), a.shape[1], b.shape[1])), np.empty((len(pieces), a.shape[1]))
    launch(gradient_sums, (a, b),
           [(products[k], sums[k], n0, n1) for k, (n0, n1) in enumerate(pieces)])
    return products.sum(axis=0).astype(a.dtype), sums.sum(axis=0).astype(a.dtype)


def _gradient_sums_gpu(be: _backend.Backend, a: Array, b: Array) -> tuple[Array, Array]:
    """CuPy twin: one GEMM and one column sum."""
    return a.T @ b, a.sum(axis=0)


_gradient_sums = _backend.twin(cpu=_gradient_sums_cpu, gpu=_gradient_sums_gpu)
"""``(a^T b, column sums of a)`` over the rows of ``a`` ``(N, R)`` and ``b`` ``(N, C)``: a weight's
and its bias's gradients summed over every step and sample."""


@dataclass(frozen=True)
class Horizon:
    """How far a back-propagation on the CPU went back from a loss on the last state alone.

    The cell's compiled kernel stops a sample where its total gradient has vanished (underflowed to
    zero: every earlier one is zero too), after checking that the saved rows it skips are finite, and
    zeroes those rows' totals and input gradients. Where that happens depends on the weights and the
    data, not on the schedule; the cost model reads the last one seen (:meth:`steps_over`).

    Attributes
    ----------
    steps : float
        Steps per sample the kernel ran, the mean over the samples.
    time_steps : int
        The run's ``T``.
    row_values : int
        Values per step and sample the stop passes over: the saved rows it checks and the totals and
        input gradients it zeroes.
    """

    steps: float
    time_steps: int
    row_values: int

    def steps_over(self, time_steps: int) -> float:
        """Predicted steps per sample of a back-propagation over ``time_steps``: this one's where its
        gradient vanished before the end, else all of them (no vanishing seen)."""
        if self.steps < self.time_steps:
            return min(float(time_steps), self.steps)
        return float(time_steps)


def compiled_back_propagation(kernel: Callable[..., None], operands: tuple[Array, ...],
                              saved: dict[str, Array], p: dict[str, Array | None], direct: Array,
                              state_size: int, extra: dict[str, tuple[int, ...]] | None = None
                              ) -> dict[str, Array]:
    """A cell's whole back-propagation on the CPU by its compiled kernel
    (:mod:`sparse_scan.recurrent._kernels`):
    each pool thread runs its samples through every step, summing its parameter gradients in float64,
    the threads' sums added last.

    Parameters
    ----------
    kernel : callable
        ``elman_backward``, ``gru_backward`` or ``lstm_backward``.
    operands : tuple of ndarray
        The cell's own operands, after the shared ones.
    saved, p : dict
        The forward's saved arrays (time-major) and the parameters.
    direct : ndarray, shape (T, B, S) or (B, S)
    state_size : int
    extra : dict, optional
        Shapes of the sums the kernel takes after the weights' and biases' (the LSTM's ``weight_hr``).

    Returns
    -------
    dict
        ``state`` ``(T + 1, B, S)``, ``x`` ``(T, B, input)``, ``weight_ih``, ``weight_hh``, ``bias_ih``,
        ``bias_hh`` and the ``extra`` sums, in the saved arrays' dtype, and ``horizon``: where
        ``direct`` is the last state's only, how far it went (:class:`Horizon`), else None.
    """
    dtype = saved["h"].dtype
    x, weight_hh = saved["x"], p["weight_hh"]
    steps, batch = x.shape[:2]
    rows = weight_hh.shape[0]
    shapes = {"weight_ih": (rows, x.shape[-1]), "weight_hh": weight_hh.shape, "bias_ih": (rows,),
              "bias_hh": (rows,), **(extra or {})}
    pieces = even_parts(batch, cpu_threads())
    sums = {key: np.empty((len(pieces),) + shape) for key, shape in shapes.items()}
    totals = np.empty((steps + 1, batch, state_size), dtype=dtype)
    grad_x = np.empty(x.shape, dtype=dtype)
    direct = np.ascontiguousarray(direct, dtype=dtype)
    shared = [np.ascontiguousarray(a, dtype=dtype) for a in (p["weight_ih"], weight_hh, x, saved["h_prev"])]
    reached = np.empty(batch, dtype=np.int64)
    launch(kernel, (*shared, direct if direct.ndim == 3 else direct[None], totals, grad_x, reached,
                    *(np.ascontiguousarray(a, dtype=dtype) for a in operands)),
           [(*(value[k] for value in sums.values()), s0, s1) for k, (s0, s1) in enumerate(pieces)])
    grads: dict[str, Any] = {"state": totals, "x": grad_x, "horizon": None}
    grads.update({key: value.sum(axis=0).astype(dtype) for key, value in sums.items()})
    if direct.ndim == 2 and batch:  # the rows a stop checks (the saved ones) and zeroes
        checked = sum(a.shape[-1] for a in (*operands, x, saved["h_prev"]) if a.ndim == 3)
        grads["horizon"] = Horizon(float(reached.mean()), steps, checked + state_size + x.shape[-1])
    return grads


def _parameters_on(source: Any, names: dict[str, str], xp: ModuleType) -> dict[str, Array]:
    """``{short name: source.<full name>}`` on the array module ``xp`` (an upload on the GPU)."""
    return {short: xp.asarray(getattr(source, full)) for short, full in names.items()}


def resolve_levels(method: str, levels: int | str | None, steps: int, batch: int, size: int,
                   device: str, cell_flops: tuple[int, ...]) -> int | str | None:
    """``levels="auto"`` of a hybrid as the modelled best depth of the scans whose cells' gradients
    take ``cell_flops`` per step and sample (:func:`cell_flops`; the CPU's BP runs factored)."""
    if method == "hybrid" and levels == "auto":
        return auto_levels(steps, batch, size, device, factored=device == "cpu", cell_flops=cell_flops)
    return levels


def cell_flops(cell: Cell, input_size: int) -> int:
    """The FLOPs per step and sample of a cell's gradients from its totals: the input's and both
    weights' (``2·rows·(2·input_size + output_size)``, ``rows`` its gate rows) and the gates' own (a
    few per row, counted as 4): the cost model's ``cell_flops``."""
    rows = cell.gates * cell.hidden_size
    return 2 * rows * (2 * input_size + cell.output_size) + 4 * rows


class Cell:
    """The arithmetic of one recurrent cell kind over a sequence (no parameters of its own).

    Parameters
    ----------
    hidden_size : int
    output_size : int
        Size of ``h`` (``proj_size`` of a projected LSTM, else ``hidden_size``).

    Attributes
    ----------
    gates : int
        Rows of ``weight_ih`` per hidden unit.
    state_size : int
        Size of the state the scan runs over (``h``, or ``(h, c)`` stacked for the LSTM).
    """

    gates = 1

    def __init__(self, hidden_size: int, output_size: int | None = None) -> None:
        self.hidden_size = hidden_size
        self.output_size = hidden_size if output_size is None else output_size

    @property
    def state_size(self) -> int:
        return self.output_size

    def forward_steps(self, xp: ModuleType, gi: Array, state0: Array, p: dict[str, Array | None]
                      ) -> dict[str, Array]:
        """The sequence from the input parts of the gates ``gi`` ``(T, B, gates*H)`` (``bias_ih``
        included) and the initial state ``(B, S)``; time-major arrays, ``"h"`` the outputs."""
        raise NotImplementedError

    def final_state(self, xp: ModuleType, saved: dict[str, Array]) -> Array:
        """The state after the last step, ``(B, S)``."""
        return saved["h"][-1]

    def factors(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None]
                ) -> tuple[Array, Array, Array | None]:
        """The blocks of the steps in ``saved`` in factored form: ``(weights_t, coefficients,
        diagonal)``, ``(K, H, H)``, ``(T, B, K, H)`` and ``(T, B, H)`` or None, with
        ``block[t, b] = Σ_k weights_t[k] diag(coefficients[t, b, k]) + diag(diagonal[t, b])``."""
        raise NotImplementedError(f"{type(self).__name__} has no Σ W diag(c) form")

    def fill(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None], out: Array) -> None:
        """Write the blocks of the steps in ``saved`` (time-major arrays) into ``out``."""
        weights_t, coefficients, diagonal = self.factors(xp, saved, p)
        fill_blocks(weights_t, coefficients, out)
        if diagonal is not None:
            index = xp.arange(self.hidden_size)
            out[:, :, index, index] += diagonal

    def chain(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None],
              direct: Array) -> Array:
        """Back-propagation through the factored blocks: the totals ``(T + 1, B, S)``."""
        return chain_through_factors(*self.factors(xp, saved, p), direct)

    def back_propagate(self, saved: dict[str, Array], p: dict[str, Array | None], direct: Array
                       ) -> dict[str, Array]:
        """Back-propagation's whole backward on the CPU by the cell's compiled kernel: the totals
        ``state`` ``(T + 1, B, S)``, ``x`` and every parameter's gradient (the biases' even where the
        run has none; see :func:`compiled_back_propagation`)."""
        raise NotImplementedError

    def pre_activation_grads(self, xp: ModuleType, saved: dict[str, Array], p: dict[str, Array | None],
                             totals: Array) -> tuple[Array, Array, dict[str, Array]]:
        """Gradients w.r.t. the input-side and hidden-side gate pre-activations, ``(T, B, gates*H)``,
        and of any parameter outside them (the LSTM's projection), from the totals ``(T, B, S)`` of
        ``s_1 .. s_T``."""
        raise NotImplementedError


def _fill_steps_cpu(be: _backend.Backend, cell: Cell, saved: dict[str, Array],
                    parameters: dict[str, Array | None], blocks: Array, threads: int | None) -> None:
    """NumPy twin: ``threads`` (default: the cores available) fill chunks of about ``CHUNK_BYTES`` of
    blocks each (the cell's temporaries of a chunk stay in cache; NumPy's ufuncs release the GIL)."""
    steps = len(blocks)
    chunk = max(1, CHUNK_BYTES // (blocks[0].nbytes or 1))
    spans = [slice(start, start + chunk) for start in range(0, steps, chunk)]
    workers = min(thread_count(threads), len(spans))

    def fill(first: int, last: int) -> None:  # chunks first .. last - 1
        for span in spans[first:last]:
            cell.fill(np, {key: value[span] for key, value in saved.items()}, parameters, blocks[span])

    with worker_pool(workers) as pool:
        run_parts(pool, fill, even_parts(len(spans), workers))


def _fill_steps_gpu(be: _backend.Backend, cell: Cell, saved: dict[str, Array],
                    parameters: dict[str, Array | None], blocks: Array, threads: int | None) -> None:
    """CuPy twin: every step at once (a few launches)."""
    cell.fill(be.xp, saved, parameters, blocks)


_fill_steps = _backend.twin(cpu=_fill_steps_cpu, gpu=_fill_steps_gpu)


class Run:
    """One layer and direction: a cell over time, reading its parameters from ``owner`` by name.

    Parameters
    ----------
    cell : Cell
    owner : object
        Holds the parameters as attributes (read at every call: an optimizer may replace them).
    names : dict
        Short name (``weight_ih``, ``weight_hh``, ``bias_ih``, ``bias_hh``, ``weight_hr``) -> the
        owner's attribute; a missing bias is zero.
    dtype : numpy dtype

    Attributes
    ----------
    horizon : Horizon or None
        Where the last back-propagation on the CPU from a loss on the last state alone stopped (None
        before one: a scan keeps the last one seen).
    """

    def __init__(self, cell: Cell, owner: Any, names: dict[str, str], dtype: Any) -> None:
        self.cell, self.owner, self.names, self.dtype = cell, owner, names, np.dtype(dtype)
        self._saved: dict[str, Array] | None = None
        self.horizon: Horizon | None = None

    def parameters_on(self, xp: ModuleType) -> dict[str, Array | None]:
        p: dict[str, Array | None] = _parameters_on(self.owner, self.names, xp)
        for key in ("bias_ih", "bias_hh", "weight_hr"):
            p.setdefault(key, None)
        return p

    @property
    def saved(self) -> dict[str, Array]:
        if self._saved is None:
            raise RuntimeError("call forward before backward")
        return self._saved

    def forward(self, x: Array, state0: Array) -> tuple[Array, Array]:
        """Run the sequence ``x`` ``(T, B, input)`` (time-major, in processing order) from
        ``state0`` ``(B, S)``; return the outputs ``(T, B, output_size)`` and the final state."""
        xp = _backend.of(x).xp
        p = self.parameters_on(xp)
        gi = x @ p["weight_ih"].T
        if p["bias_ih"] is not None:
            gi += p["bias_ih"]
        saved = self.cell.forward_steps(xp, gi, state0, p)
        size = self.cell.output_size
        saved.update(x=x, h_prev=xp.concatenate([state0[None, :, :size], saved["h"][:-1]]))
        self._saved = saved
        return saved["h"], self.cell.final_state(xp, saved)

    def load(self, saved: dict[str, Array]) -> None:
        """Take the saved arrays of a forward run elsewhere (steps recorded one by one)."""
        self._saved = saved

    def jacobian_factors(self) -> tuple[Array, Array, Array | None]:
        """Every ``(ds_t/ds_{t-1})^T`` of the last forward in the cell's ``Σ W diag(c)`` form."""
        saved = self.saved
        xp = _backend.of(saved["h"]).xp
        return self.cell.factors(xp, saved, self.parameters_on(xp))

    def factored_chain(self, direct: Array) -> Array:
        """Back-propagation through the factored blocks of the last forward (no block filled)."""
        saved = self.saved
        xp = _backend.of(saved["h"]).xp
        return self.cell.chain(xp, saved, self.parameters_on(xp), direct)

    def transposed_jacobians(self, threads: int | None = None) -> Array:
        """Every ``(ds_t/ds_{t-1})^T`` of the last forward, time-major ``(T, B, S, S)``.

        On the CPU, ``threads`` (default: the cores available) fill chunks of about ``CHUNK_BYTES``
        of blocks each (the cells' temporaries of a chunk stay in cache).
        """
        saved = self.saved
        be = _backend.of(saved["h"])
        steps, batch = saved["h"].shape[:2]
        size = self.cell.state_size
        blocks = be.xp.empty((steps, batch, size, size), dtype=self.dtype)  # C order: the scan reads it
        _fill_steps(be, self.cell, saved, self.parameters_on(be.xp), blocks, threads)
        return blocks

    def gradients(self, totals: Array) -> dict[str, Array]:
        """The gradients from the totals ``(T + 1, B, S)`` of a scan: the cell's gate pre-activation
        gradients, then each parameter's one GEMM or one sum over all steps and samples."""
        saved = self.saved
        be = _backend.of(saved["h"])
        p = self.parameters_on(be.xp)
        grad_gi, grad_gh, extra = self.cell.pre_activation_grads(be.xp, saved, p, totals[1:])
        x, rows, size = saved["x"], grad_gi.shape[-1], self.cell.output_size
        weight_ih, bias_ih = _gradient_sums(be, grad_gi.reshape(-1, rows), x.reshape(-1, x.shape[-1]))
        weight_hh, bias_hh = _gradient_sums(be, grad_gh.reshape(-1, rows), saved["h_prev"].reshape(-1, size))
        return {"state": totals, "x": grad_gi @ p["weight_ih"], "weight_ih": weight_ih,
                "weight_hh": weight_hh, "bias_ih": bias_ih, "bias_hh": bias_hh, **extra}

    def backward(self, direct: Array, method: str, levels: int | None,
                 threads: int | None = None) -> dict[str, Array]:
        """Gradients through the last forward.

        Parameters
        ----------
        direct : ndarray, shape (T, B, S) or (B, S)
            The loss's direct gradient w.r.t. every state ``s_1 .. s_T`` (time-major, processing
            order), or w.r.t. the last one only.
        method, levels, threads
            Of the scan (levels resolved: an int for a hybrid, else None).

        Returns
        -------
        dict
            ``state`` ``(T + 1, B, S)``: total gradients w.r.t. ``s_0 .. s_T``; ``x`` ``(T, B,
            input)``; and every parameter's gradient by short name (summed over the batch).
        """
        be = _backend.of(self.saved["h"])
        if method == "linear" or (method == "hybrid" and levels == 0):
            grads = _bp_gradients(be, self, direct, threads)
            self.horizon = grads.pop("horizon") or self.horizon
        else:
            totals = dense_scan(self.transposed_jacobians(threads), direct, method, levels, threads)
            grads = self.gradients(totals)
        return {key: value for key, value in grads.items() if key in ("state", "x") or key in self.names}

