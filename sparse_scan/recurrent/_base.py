"""What recurrent layers share: parameters by PyTorch name, input checks, backward through the scan.

A subclass defines the cell: ``_forward_steps`` (the sequential forward, keeping what the Jacobians
need), ``_factors`` (every ``(dh_t/dh_{t-1})^T`` as weight matrices times per-step diagonals, from
which the blocks are filled in one batched pass split over time between the CPU's threads) and
``_pre_activation_grads`` (gradients of the gate pre-activations from the total gradients w.r.t. the
hidden states), from which every input and parameter gradient is one GEMM or one sum over all steps
and samples.

Back-propagation's schedule (``linear``, or a ``hybrid`` of depth 0) needs no block at all on the CPU:
each step applies ``Σ_k W_k^T diag(c_k)`` to one vector per sample, one GEMM over the samples
(:func:`chain_through_factors`), so the ``T·B·H²`` block values are neither filled nor read. On a GPU
that loop would be a few launches per step; there the blocks are filled (a few launches over all
steps) and the chain of ``T`` products is one launch (``dense_scan_chain``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import backend as _backend
from .._checks import integer
from .._threads import cpu_threads, even_parts, run_parts, worker_pool
from ..dense_scan import auto_levels, dense_scan
from ..layers._weighted import RngLike, as_float_dtype, as_rng
from ..scan import checked_levels

__all__ = ["Recurrent", "chain_through_factors", "fill_blocks"]

CHUNK_BYTES = 2**20  # blocks filled per task on the CPU


def _fill_cpu(be: _backend.Backend, weights_t: Any, coefficients: Any, out: Any) -> None:
    # one pass over the output (NumPy's einsum loops beat broadcasting's H-long inner loops 2x, and
    # need contiguous weights to do so)
    np.einsum("kij,tbkj->tbij", np.ascontiguousarray(weights_t), coefficients, out=out,
              optimize=len(weights_t) > 1)


def _fill_gpu(be: _backend.Backend, weights_t: Any, coefficients: Any, out: Any) -> None:
    be.xp.multiply(weights_t[0], coefficients[:, :, 0, None, :], out=out)
    for k in range(1, len(weights_t)):
        out += weights_t[k] * coefficients[:, :, k, None, :]


_fill = _backend.twin(cpu=_fill_cpu, gpu=_fill_gpu)


def fill_blocks(weights_t: Any, coefficients: Any, out: Any) -> None:
    """``out[t, b] = Σ_k weights_t[k] · diag(coefficients[t, b, k])``: Jacobian blocks of a cell.

    Parameters
    ----------
    weights_t : ndarray, shape (K, H, H)
        Transposed recurrent weight matrices.
    coefficients : ndarray, shape (T, B, K, H)
        Per step and sample, the column scaling of each matrix.
    out : ndarray, shape (T, B, H, H)
    """
    _fill(_backend.of(out), weights_t, coefficients, out)


def chain_through_factors(weights_t: Any, coefficients: Any, diagonal: Any, direct: Any) -> Any:
    """Back-propagation through time with every block left in factored form.

    ``G_{t-1} = d_{t-1} + A_t G_t`` with ``A_t = Σ_k weights_t[k] diag(coefficients[t-1, :, k])
    (+ diag(diagonal[t-1]))``, applied to the samples' vectors as one GEMM per step:
    ``(G_t ⊙ c_{t,k})_k`` stacked ``(B, K·H)`` times the stacked ``W_k`` ``(K·H, H)``. The result
    equals :func:`~sparse_scan.dense_scan.dense_scan` of the filled blocks with ``method="linear"``.

    Parameters
    ----------
    weights_t : ndarray, shape (K, H, H)
    coefficients : ndarray, shape (T, B, K, H)
    diagonal : ndarray, shape (T, B, H), or None
    direct : ndarray, shape (T, B, H) or (B, H)
        As in :func:`~sparse_scan.dense_scan.dense_scan`.

    Returns
    -------
    ndarray, shape (T + 1, B, H)
        ``out[t]``: the total gradient w.r.t. ``h_t``.
    """
    xp = _backend.of(coefficients).xp
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


def _back_propagate_cpu(be: _backend.Backend, layer: "Recurrent", direct: Any, threads: int | None) -> Any:
    """NumPy twin: BP through the factors, no block filled."""
    return chain_through_factors(*layer.jacobian_factors(), direct)


def _back_propagate_gpu(be: _backend.Backend, layer: "Recurrent", direct: Any, threads: int | None) -> Any:
    """CUDA twin: fill the blocks, then the chain in one launch."""
    return dense_scan(layer.transposed_jacobians(threads), direct, "linear")


_back_propagate = _backend.twin(cpu=_back_propagate_cpu, gpu=_back_propagate_gpu)


class Recurrent:
    """Base of :class:`~sparse_scan.recurrent.RNN` and :class:`~sparse_scan.recurrent.GRU`.

    Attributes
    ----------
    weight_ih : ndarray, shape (gates * hidden_size, input_size)
    weight_hh : ndarray, shape (gates * hidden_size, hidden_size)
    bias_ih, bias_hh : ndarray, shape (gates * hidden_size,)
    name : str or None
        Prefix of this layer's parameters in a model's state_dict.
    """

    gates = 1
    parameter_names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")

    def __init__(self, input_size: int, hidden_size: int, *, dtype: Any = None, rng: RngLike = None,
                 name: str | None = None) -> None:
        self.input_size = integer(input_size, f"layer {type(self).__name__}: input_size", 1)
        self.hidden_size = integer(hidden_size, f"layer {type(self).__name__}: hidden_size", 1)
        self.dtype = as_float_dtype(dtype, type(self).__name__)
        self.name = name
        generator, bound = as_rng(rng), 1.0 / math.sqrt(self.hidden_size)  # PyTorch's initialisation
        for key, shape in self.parameter_shapes().items():
            setattr(self, key, generator.uniform(-bound, bound, shape).astype(self.dtype))
        self._saved: dict[str, Any] | None = None

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """PyTorch's shapes of the parameters, by name."""
        rows = self.gates * self.hidden_size
        return {"weight_ih": (rows, self.input_size), "weight_hh": (rows, self.hidden_size),
                "bias_ih": (rows,), "bias_hh": (rows,)}

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters by name (not copies)."""
        return {key: getattr(self, key) for key in self.parameter_names}

    def load_state_dict(self, values: dict[str, Any]) -> None:
        """Copy parameters in, by this layer's names or ``nn.RNN``/``nn.GRU``'s (``weight_ih_l0``, ...).

        Raises
        ------
        ValueError
            A name is unknown or missing, or a value has the wrong shape or is not finite.
        """
        shapes = self.parameter_shapes()
        given = {key.removesuffix("_l0"): value for key, value in values.items()}
        unknown = sorted(set(given) - set(shapes))
        missing = sorted(set(shapes) - set(given))
        if unknown or missing:
            raise ValueError(f"layer {type(self).__name__}: state_dict: unknown {unknown}, "
                             f"missing {missing}")
        checked = {}
        for key, value in given.items():
            array = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
            if array.dtype.kind not in "fiu":
                raise ValueError(f"layer {type(self).__name__}: {key}: expected real numbers, "
                                 f"got {array.dtype}")
            if array.shape != shapes[key]:
                raise ValueError(f"layer {type(self).__name__}: {key}: expected shape {shapes[key]}, "
                                 f"got {array.shape}")
            if not np.all(np.isfinite(array)):
                raise ValueError(f"layer {type(self).__name__}: {key}: values must be finite")
            checked[key] = array.astype(self.dtype)
        for key, array in checked.items():
            setattr(self, key, array)

    def _check_inputs(self, x: Any, h0: Any) -> tuple[Any, Any]:
        layer = f"layer {type(self).__name__}"
        x = x if hasattr(x, "dtype") else np.asarray(x)
        h0 = h0 if h0 is None or hasattr(h0, "dtype") else np.asarray(h0)
        be = _backend.of(x)
        xp = be.xp
        for field, value in (("input", x), ("h0", h0)):
            if value is not None and value.dtype.kind not in "fiu":  # complex would lose its imaginary part
                raise ValueError(f"{layer}: {field}: expected real numbers, got {value.dtype}")
        if x.ndim != 3 or x.shape[2] != self.input_size or x.shape[1] < 1:
            raise ValueError(f"{layer}: input: expected (batch, time, {self.input_size}) with time >= 1, "
                             f"got {tuple(x.shape)}")
        if not bool(xp.all(xp.isfinite(x))):
            raise ValueError(f"{layer}: input: values must be finite")
        x = xp.asarray(x, dtype=self.dtype)
        if h0 is None:
            return x, xp.zeros((x.shape[0], self.hidden_size), dtype=self.dtype)
        h0 = be.asarray(h0, dtype=self.dtype)
        if tuple(h0.shape) != (x.shape[0], self.hidden_size):
            raise ValueError(f"{layer}: h0: expected ({x.shape[0]}, {self.hidden_size}), "
                             f"got {tuple(h0.shape)}")
        if not bool(xp.all(xp.isfinite(h0))):  # sync: the check must raise before h0 is used
            raise ValueError(f"{layer}: h0: values must be finite")
        return x, h0

    def _parameters_on(self, xp: Any) -> dict[str, Any]:
        return {key: xp.asarray(getattr(self, key)) for key in self.parameter_names}

    def forward(self, x: Any, h0: Any = None) -> Any:
        """Run the sequence; keep what the Jacobians and the parameter gradients need.

        Parameters
        ----------
        x : ndarray, shape (B, T, input_size)
            Batch first, NumPy (CPU) or CuPy (GPU).
        h0 : ndarray, shape (B, hidden_size), optional
            Initial hidden state (zeros by default).

        Returns
        -------
        ndarray, shape (B, T, hidden_size)
            Every hidden state ``h_1 .. h_T``.
        """
        x, h0 = self._check_inputs(x, h0)
        xp = _backend.of(x).xp
        x_steps = xp.ascontiguousarray(x.transpose(1, 0, 2))  # time-major inside
        saved = self._forward_steps(xp, x_steps, h0, self._parameters_on(xp))
        saved.update(x=x_steps, h_prev=xp.concatenate([h0[None], saved["h"][:-1]]))
        self._saved = saved
        return xp.ascontiguousarray(saved["h"].transpose(1, 0, 2))

    def _require_forward(self) -> dict[str, Any]:
        if self._saved is None:
            raise RuntimeError(f"layer {type(self).__name__}: call forward before backward")
        return self._saved

    def jacobian_factors(self) -> tuple[Any, Any, Any]:
        """Every ``(dh_t/dh_{t-1})^T`` of the last forward in factored form: ``(weights_t,
        coefficients, diagonal)`` of shapes ``(K, H, H)``, ``(T, B, K, H)`` and ``(T, B, H)`` (or
        None), ``block[t, b] = Σ_k weights_t[k] diag(coefficients[t, b, k]) + diag(diagonal[t, b])``
        (the input of :func:`chain_through_factors`)."""
        saved = self._require_forward()
        xp = _backend.of(saved["h"]).xp
        return self._factors(xp, saved, self._parameters_on(xp))

    def transposed_jacobians(self, threads: int | None = None) -> Any:
        """Every ``(dh_t/dh_{t-1})^T`` of the last forward, time-major ``(T, B, H, H)``.

        On the CPU, ``threads`` (default: the cores available) fill chunks of about ``CHUNK_BYTES``
        of blocks each (the cells' temporaries of a chunk stay in cache).
        """
        saved = self._require_forward()
        xp = _backend.of(saved["h"]).xp
        parameters = self._parameters_on(xp)
        steps, batch, size = saved["h"].shape
        blocks = xp.empty((steps, batch, size, size), dtype=self.dtype)  # C order: the scan reads it
        if xp is not np:
            self._blocks(xp, saved, parameters, blocks)
            return blocks
        chunk = max(1, CHUNK_BYTES // (blocks[0].nbytes or 1))
        spans = [slice(start, start + chunk) for start in range(0, steps, chunk)]
        workers = min(cpu_threads() if threads is None else max(1, int(threads)), len(spans))

        def fill(first: int, last: int) -> None:  # chunks first .. last - 1
            for span in spans[first:last]:
                self._blocks(xp, {key: value[span] for key, value in saved.items()}, parameters,
                             blocks[span])

        with worker_pool(workers) as pool:  # NumPy's ufuncs release the GIL
            run_parts(pool, fill, even_parts(len(spans), workers))
        return blocks

    def backward(self, grad_h: Any, method: str = "blelloch", levels: int | str | None = None,
                 threads: int | None = None) -> dict[str, Any]:
        """Gradients of a loss through the last forward, by a scan over the hidden-state chain.

        Parameters
        ----------
        grad_h : ndarray, shape (B, T, hidden_size) or (B, hidden_size)
            The loss's direct gradient w.r.t. every hidden state, or w.r.t. the last one only.
        method : {"blelloch", "linear", "hybrid"}
            ``linear`` is back-propagation through time emulated with the Jacobians.
        levels : int or "auto", optional
            Up-sweep levels of ``hybrid``; ``"auto"`` picks them from the scan's cost model.
        threads : int, optional
            CPU threads sharing each scan level.

        Returns
        -------
        dict
            ``h`` (B, T, H): total gradient w.r.t. each ``h_t``; ``x`` (B, T, input_size); ``h0``
            (B, H); and ``weight_ih``, ``weight_hh``, ``bias_ih``, ``bias_hh`` (summed over the batch).
        """
        saved = self._require_forward()
        be = _backend.of(saved["h"])
        xp = be.xp
        steps, batch, size = saved["h"].shape
        layer = f"layer {type(self).__name__}"
        grad_h = grad_h if hasattr(grad_h, "shape") else np.asarray(grad_h)
        if tuple(grad_h.shape) not in ((batch, steps, size), (batch, size)):
            raise ValueError(f"{layer}: grad_h: expected ({batch}, {steps}, {size}) or ({batch}, {size}), "
                             f"got {tuple(grad_h.shape)}")
        if method == "hybrid" and levels == "auto":
            levels = auto_levels(steps, batch, size, be.name, factored=be.name == "cpu")
        levels = checked_levels(steps, method, levels, unit="time steps")
        grad_h = xp.asarray(grad_h, dtype=self.dtype)
        direct = grad_h if grad_h.ndim == 2 else xp.ascontiguousarray(grad_h.transpose(1, 0, 2))
        parameters = self._parameters_on(xp)
        if method == "linear" or (method == "hybrid" and levels == 0):
            totals = _back_propagate(be, self, direct, threads)
        else:
            totals = dense_scan(self.transposed_jacobians(threads), direct, method, levels, threads)
        grad_gi, grad_gh = self._pre_activation_grads(xp, saved, totals[1:])
        x, rows = saved["x"], grad_gi.shape[-1]
        flat_gi, flat_gh = grad_gi.reshape(-1, rows), grad_gh.reshape(-1, rows)
        return {
            "h": xp.ascontiguousarray(totals[1:].transpose(1, 0, 2)),
            "x": xp.ascontiguousarray((grad_gi @ parameters["weight_ih"]).transpose(1, 0, 2)),
            "h0": totals[0],
            "weight_ih": flat_gi.T @ x.reshape(-1, self.input_size),
            "weight_hh": flat_gh.T @ saved["h_prev"].reshape(-1, size),
            "bias_ih": flat_gi.sum(axis=0),
            "bias_hh": flat_gh.sum(axis=0),
        }

    # cell-specific parts -------------------------------------------------------------------------
    def _forward_steps(self, xp: Any, x: Any, h0: Any, p: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _blocks(self, xp: Any, saved: dict[str, Any], p: dict[str, Any], out: Any) -> None:
        """Write the blocks of the steps in ``saved`` (time-major arrays) into ``out``."""
        weights_t, coefficients, diagonal = self._factors(xp, saved, p)
        fill_blocks(weights_t, coefficients, out)
        if diagonal is not None:
            index = xp.arange(self.hidden_size)
            out[:, :, index, index] += diagonal

    def _factors(self, xp: Any, saved: dict[str, Any], p: dict[str, Any]) -> tuple[Any, Any, Any]:
        """The blocks of the steps in ``saved`` in factored form: ``(weights_t, coefficients,
        diagonal)``, ``(K, H, H)``, ``(T, B, K, H)`` and ``(T, B, H)`` or None, with
        ``block[t, b] = Σ_k weights_t[k] diag(coefficients[t, b, k]) + diag(diagonal[t, b])``."""
        raise NotImplementedError

    def _pre_activation_grads(self, xp: Any, saved: dict[str, Any], totals: Any) -> tuple[Any, Any]:
        """Gradients w.r.t. the input-side and hidden-side gate pre-activations, ``(T, B, gates*H)``."""
        raise NotImplementedError
