"""The backward scan across MPI processes: each rank holds a contiguous slice of the layers.

With ``P`` ranks, rank ``r`` holds layers ``a_r+1 .. b_r`` of a :class:`~sparse_scan.Sequential`
(``x_{a_r}`` in, ``x_{b_r}`` out). :func:`backward`, called on every rank (``mpirun -n P``):

1. **forward**: rank 0 runs its slice on ``x`` and passes ``x_{b_0}`` to rank 1, and so on; the last
   rank sends the model output to rank 0, which turns it into ``g_n`` (an array, or a callable such
   as a loss) and sends that back;
2. **slice products**: every middle rank reduces its slice's JTs to one matrix
   ``S_r = JT_{a_r+1} ··· JT_{b_r}`` (a planned tree of sparse products,
   :class:`~sparse_scan.distributed._slices.SliceProduct`); the last rank runs its local scan with ``g_n``,
   whose first result ``g_{a_{P-1}}`` is its contribution (a vector);
3. **combine**: the exclusive scan of ``[g_{a_{P-1}}, S_{P-2}, ..., S_1]`` under ``A ◇ B = B·A`` gives
   each rank the gradient w.r.t. its slice output ``g_{b_r}``. ``combine="chain"`` (the default) sends
   vectors down the ranks, one SpMV by ``S_r`` each (``P - 1`` steps, vector messages); a middle rank
   relays instead (below) when its slice product does not pay: when even a dense ``S_r``'s SpMV
   would cost more than back-propagation through the slice, or forming it more than
   ``CHAIN_PRODUCT_FACTOR`` times that (products of convolution JTs fill in); its stats say
   ``relayed``;
   ``combine="exscan"`` is mpi4py's ``exscan`` with ``◇`` as the (non-commutative) operator
   (``ceil(log2 P)`` rounds, but its partial results between middle ranks are products of slice
   products: sparse matrices, much larger than vectors); ``combine="relay"`` forms no slice product:
   each rank runs its local scan when the vector reaches it and relays its first result (the
   critical path of back-propagation, but no product fill-in: for convolution stacks, whose slice
   products are near-dense);
4. **finish**: each rank runs its local scan (``method``, ``levels``) from ``g_{b_r}``, then its
   parameter gradients; rank 0 gathers everything.

Every wait polls against ``timeout`` and checks for failure notices, so a failed or stuck rank
ends the others with a :class:`DistributedError` naming it instead of a hang (a command-line program
should then end every rank with :func:`abort`; ``sparse-scan run --distributed`` does).

With ``device="gpu"`` each rank runs its slice on a GPU (``local rank % visible devices`` unless
``gpu_device`` says which), with CuPy arrays end to end, and the messages' device arrays move by the
transport chosen with every rank (:mod:`~sparse_scan.distributed._transport`: CUDA-aware MPI, NCCL or
host staging through pinned buffers; ``transport`` forces one). The steps above are the same.

Examples
--------
Under ``mpirun -n 2 python script.py``::

    import numpy as np
    from mpi4py import MPI
    import sparse_scan
    from sparse_scan import distributed

    model = sparse_scan.load_model("data/lenet5.yaml", dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((4,) + model.input_shape)
    result = distributed.backward(model, x, np.ones_like, comm=MPI.COMM_WORLD)
    if MPI.COMM_WORLD.rank == 0:
        print([g.shape for g in result.grads], sorted(result.parameters))

The split balances the linear scan plan's per-layer FLOPs (:func:`layer_costs`):

>>> balanced_split([10, 1, 1, 10], 2)
[2, 2]
>>> balanced_split([1, 1, 1, 9], 3)
[2, 1, 1]
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .. import backend as _backend
from .._sequential import Sequential, default_memory_budget
from ..engine.plan import ScanCostError
from ..engine.products import PlanBudgetError
from ._mpi import (
    Channel,
    DistributedError,
    MPIUnavailableError,
    RankTimeoutError,
    RemoteRankError,
    abort,
    import_mpi,
    launched,
    launcher,
)
from ._slices import SliceMatrix, SliceProduct, apply, combine
from ._transport import GPU_TRANSPORTS, TransportUnavailableError, connect

__all__ = ["CHAIN_PRODUCT_FACTOR", "COMBINES", "DistributedError", "DistributedResult", "MPIUnavailableError",
           "RankTimeoutError", "RemoteRankError", "TRANSPORTS", "TransportUnavailableError", "abort",
           "backward", "balanced_split", "import_mpi", "launched", "launcher", "layer_costs", "slices"]

COMBINES = ("chain", "exscan", "relay")
TRANSPORTS = ("auto",) + GPU_TRANSPORTS
"""``transport`` choices of GPU ranks (``"auto"``: the first available of the others, in this order)."""
CHAIN_PRODUCT_FACTOR = 32  # chain: a slice product may cost this many times BP's FLOPs (module doc)
TAG_ACTIVATION, TAG_OUTPUT, TAG_GRAD_OUT, TAG_VECTOR, TAG_GATHER, TAG_EXSCAN = 1, 2, 3, 4, 5, 10


@dataclass
class DistributedResult:
    """What :func:`backward` returns on each rank.

    Attributes
    ----------
    rank, size : int
    bounds : list of tuple of int
        ``(a_r, b_r)`` of every rank: it holds layers ``a_r .. b_r - 1`` (0-based).
    output : ndarray or None
        The model output (rank 0), on the rank's device (a CuPy array on GPU ranks).
    grads : list of ndarray or None
        Rank 0: the gradients w.r.t. ``x_0 .. x_n``, as :meth:`Sequential.backward`; other ranks:
        those of their slice, ``x_{a_r} .. x_{b_r}``. On the rank's device.
    parameters : dict
        Rank 0: every parameter gradient (as :meth:`Sequential.parameter_gradients`); other ranks:
        those of their slice. On the rank's device.
    stats : dict
        This rank's ``timings`` (seconds per phase), ``device`` (``cpu`` or ``gpu:N``),
        ``transport`` (``mpi`` on CPU ranks: arrays inside the pickled messages), ``sent_bytes``
        (array payload sent), ``messages``, ``product_flops`` and ``product_nnz`` (its slice product,
        middle ranks); on GPU ranks ``transport_sent_bytes`` and ``transport_received_bytes`` (the
        device arrays' bytes the transport moved); on rank 0 also ``ranks``: every rank's stats.
    """

    rank: int
    size: int
    bounds: list[tuple[int, int]]
    output: Any = None
    grads: list[Any] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)


def layer_costs(model: Sequential, in_shape: Sequence[int]) -> list[int]:
    """Per layer, the FLOPs of its step in the linear scan plan (its JT's SpMV, ``2·nnz``).

    These are the :class:`~sparse_scan.ScanPlan`'s own figures (``model.plan(in_shape,
    "linear")``); the cost of a slice is the sum over its layers.
    """
    n = len(model)
    costs = [0] * n
    for step in model.plan(in_shape, "linear").steps:
        costs[n - step.right.hi] = step.flops
    return costs


def balanced_split(costs: Sequence[float], parts: int) -> list[int]:
    """Contiguous layer counts per part, each at least 1, minimising the costliest part.

    A bisection on the costliest part's cost, each candidate checked by a greedy walk over the
    prefix sums (``O(parts · log n)``), so that chains of many thousands of layers split at once;
    then each part aims at an equal share of the cost left, within that optimal limit.

    Parameters
    ----------
    costs : sequence of float
        Per layer, non-negative.
    parts : int
        Number of parts, ``1 <= parts <= len(costs)``.

    Returns
    -------
    list of int
        Layers per part, in order.
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} layers over {parts} ranks: each rank needs at least one "
                         f"layer (use at most {n} ranks)")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=float))))

    def cut(limit: float, even: bool = False) -> list[int] | None:
        ends, start = [], 0
        for k in range(parts):
            if k == parts - 1:
                stop = n
            else:  # at most as far as the limit allows, leaving a layer for each later part
                stop = int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1
                stop = min(stop, n - (parts - 1 - k))
                if even:  # the boundary nearest an equal share of what is left
                    share = prefix[start] + (prefix[n] - prefix[start]) / (parts - k)
                    near = int(np.searchsorted(prefix, share))
                    if near > start + 1 and share - prefix[near - 1] <= prefix[near] - share:
                        near -= 1
                    stop = max(start + 1, min(stop, near))
            if stop <= start or prefix[stop] - prefix[start] > limit:
                return None
            ends.append(stop)
            start = stop
        return [b - a for a, b in zip([0] + ends[:-1], ends, strict=True)]

    low, high = float(max(costs)), float(prefix[-1])
    while high - low > 1e-9 * max(high, 1.0):
        middle = (low + high) / 2
        if cut(middle) is None:
            low = middle
        else:
            high = middle
    return cut(high, even=True) or cut(high)


def slices(model: Sequential, size: int, split: Sequence[int] | None = None,
           in_shape: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """``(a_r, b_r)`` per rank: ``split`` (layers per rank), else balanced by :func:`layer_costs`."""
    n = len(model)
    if size > n:
        raise ValueError(f"{size} ranks but the model has {n} layers: each rank needs at least one layer "
                         f"(run with at most {n} ranks)")
    if split is None:
        if in_shape is None:
            raise ValueError("a balanced split needs the per-sample input shape")
        counts = balanced_split(layer_costs(model, in_shape), size)
    else:
        counts = [int(c) for c in split]
        if len(counts) != size or min(counts) < 1 or sum(counts) != n:
            raise ValueError(f"split {list(split)} must give {size} positive layer counts (one per rank) "
                             f"summing to the model's {n} layers")
    ends = np.cumsum([0] + counts).tolist()
    return list(zip(ends[:-1], ends[1:], strict=True))


def _op(earlier: Any, later: Any) -> Any:
    """``earlier ◇ later = later · earlier`` on vectors and slice matrices (None: the identity)."""
    if earlier is None:
        return later
    if later is None:
        return earlier
    if isinstance(earlier, SliceMatrix):
        return combine(later, earlier)
    return apply(later, earlier)


def backward(model: Sequential, x: Any, grad_out: Any, comm: Any = None, split: Sequence[int] | None = None,
             method: str = "blelloch", levels: int | str | None = None, combine: str = "chain",
             timeout: float = 300.0, gather: bool = True, *, device: str = "cpu", transport: str = "auto",
             gpu_device: int | None = None) -> DistributedResult:
    """Gradients w.r.t. every activation and parameter, with the layers split over MPI ranks.

    Call it on every rank of ``comm`` with the same model, split and options.

    Parameters
    ----------
    model : Sequential
        The whole model, on every rank (each rank runs only its slice).
    x : ndarray, shape (B, *input_shape)
        The batch, on rank 0 (other ranks may pass None).
    grad_out : ndarray or callable
        On rank 0: ``dL/dx_n``, or a callable ``output -> dL/dx_n`` (a loss; it may also be
        ``np.ones_like``-like). Other ranks may pass None.
    comm : mpi4py communicator, optional
        ``MPI.COMM_WORLD`` by default.
    split : sequence of int, optional
        Layers per rank (in order); by default balanced by :func:`layer_costs`.
    method, levels
        The local scan of each slice (:meth:`Sequential.backward`).
    combine : {"chain", "exscan", "relay"}
        How slices are combined across ranks (module docstring).
    timeout : float
        Seconds any wait on another rank may take before :class:`RankTimeoutError`.
    gather : bool
        Collect every gradient on rank 0 (otherwise each rank keeps its slice's).
    device : {"cpu", "gpu"}
        Where each rank runs its slice: ``"gpu"`` needs a usable GPU on every rank (else
        :class:`~sparse_scan.backend.GPUUnavailableError`; no rank falls back to the CPU).
    transport : {"auto", "cuda-aware", "nccl", "staging"}
        GPU ranks: how device arrays move (:data:`TRANSPORTS`; the module docstring).
    gpu_device : int, optional
        GPU ranks: this rank's device (default: its local rank modulo the devices it sees).

    Returns
    -------
    DistributedResult

    Raises
    ------
    ValueError
        A model that is not a :class:`~sparse_scan.Sequential`, more ranks than layers, or a bad
        ``split``/``combine``/``device`` (on every rank alike); a ``transport`` that is not available
        (:class:`TransportUnavailableError`, on every rank alike, naming why).
    DistributedError
        A rank failed (:class:`RemoteRankError`) or did not answer in time
        (:class:`RankTimeoutError`); both name the rank.
    """
    if not isinstance(model, Sequential):
        raise ValueError(f"the distributed scan splits the layers of a Sequential, not a "
                         f"{type(model).__name__} (whose scans run in one process)")
    if comm is None:
        comm = import_mpi().COMM_WORLD
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {', '.join(COMBINES)}; got {combine!r}")
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be cpu or gpu; got {device!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
    be = _backend.get(device)
    if model.input_shape is None:
        raise ValueError("the model has no input_shape: set it (Sequential(..., input_shape=...)) so that "
                         "every rank knows its slice's shapes")
    in_shape = model.input_shape
    bounds = slices(model, comm.Get_size(), split, in_shape)
    channel = Channel(comm, timeout)
    try:
        if be.name == "gpu":
            channel.transport = connect(comm, be.xp, transport, gpu_device,
                                        lambda obj: channel.allgather(obj, "the transport's facts"))
        result = _run(model, x, grad_out, channel, bounds, in_shape, method, levels, combine, gather, be)
        channel.flush()
    except RemoteRankError:
        raise
    except BaseException as error:
        channel.notify_failure(error)
        raise
    return result


def _run(model: Sequential, x: Any, grad_out: Any, channel: Channel, bounds: list[tuple[int, int]],
         in_shape: tuple[int, ...], method: str, levels: Any, combine_with: str, gather: bool,
         be: _backend.Backend) -> DistributedResult:
    rank, size = channel.rank, channel.size
    last = size - 1
    a, b = bounds[rank]
    local = Sequential(*model.layers[a:b], memory_budget=model.memory_budget)
    local.subnormals.every = 0  # a model per call: its first backward would count every time
    clock = [time.perf_counter()]
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        clock.append(time.perf_counter())
        timings[name] = clock[-1] - clock[-2]

    # 1. forward, slice by slice
    inputs = x if rank == 0 else channel.recv(rank - 1, TAG_ACTIVATION, "activations")
    output = local.forward(be.asarray(inputs))
    if rank < last:
        channel.send(output, rank + 1, TAG_ACTIVATION, "activations")
    lap("forward_s")
    # the loss gradient: computed on rank 0 from the output
    model_output = None
    if rank == last and last > 0:
        channel.send(output, 0, TAG_OUTPUT, "the model output")
    if rank == 0:
        model_output = output if last == 0 else channel.recv(last, TAG_OUTPUT, "the model output", hops=last)
        g_n = be.asarray(grad_out(model_output) if callable(grad_out) else grad_out)
        if g_n.shape != model_output.shape:
            raise ValueError(f"grad_out has shape {g_n.shape}; the output has {model_output.shape}")
        if last > 0:
            channel.send(g_n, last, TAG_GRAD_OUT, "the output gradient")
    if rank == last and last > 0:
        g_n = channel.recv(0, TAG_GRAD_OUT, "the output gradient")
    lap("output_grad_s")
    # 2. contributions: the last rank's local scan (a vector), the middle ranks' slice products
    transport = channel.transport
    stats: dict[str, Any] = {"rank": rank, "layers": [a, b], "timings": timings,
                             "device": "cpu" if be.name == "cpu" else f"gpu:{be.xp.cuda.Device().id}",
                             "transport": "mpi" if transport is None else transport.name}
    grads = local.backward(g_n, method, levels) if rank == last else None
    product = None
    if 0 < rank < last and combine_with != "relay":
        product = _slice_product(local, model, in_shape, (a, b), combine_with == "chain", stats)
    lap("contribution_s")
    # 3. combine across ranks: each rank but the last gets g_b (the gradient w.r.t. its slice output)
    vector = None if rank < last else grads[0].reshape(len(g_n), -1)
    if combine_with != "exscan":
        if rank < last:
            g_b = channel.recv(rank + 1, TAG_VECTOR, "the gradient of its slice output", hops=last - rank)
            if rank > 0 and product is None:  # relay: the local scan first
                grads = local.backward(be.asarray(g_b).reshape(output.shape), method, levels)
                vector = grads[0].reshape(len(g_b), -1)
            elif rank > 0:  # chain: one SpMV with the slice product, the local scan after
                vector = apply(product, g_b.reshape(len(g_b), -1))
        if rank > 0:
            channel.send(vector, rank - 1, TAG_VECTOR, "the gradient of a slice output")
    elif last > 0:
        g_b = _exscan(channel, vector if rank == last else product)
    lap("combine_s")
    # 4. finish the slice locally
    if rank < last and grads is None:
        g_b = be.asarray(g_b).reshape(output.shape)
        grads = local.backward(g_b, method, levels)
    parameters = local.parameter_gradients(grads)
    lap("finish_s")
    stats.update(sent_bytes=channel.sent_bytes, messages=channel.messages)
    if transport is not None:
        stats.update(transport_sent_bytes=transport.sent_bytes,
                     transport_received_bytes=transport.received_bytes)
    result = DistributedResult(rank, size, bounds, model_output, grads, parameters, stats)
    if gather:
        _gather(channel, result)
        lap("gather_s")
    stats["timings"]["total_s"] = clock[-1] - clock[0]
    return result


def _slice_product(local: Sequential, model: Sequential, in_shape: tuple[int, ...], bounds: tuple[int, int],
                   optional: bool, stats: dict[str, Any]) -> SliceMatrix | None:
    """A middle rank's slice product, or None where ``optional`` (chain) and it does not pay.

    It does not pay when even a dense product's SpMV would cost more than back-propagation through
    the slice (``2·in·out`` FLOPs against the linear plan's), or when forming it would cost more than
    ``CHAIN_PRODUCT_FACTOR`` times that (checked before each product is planned).
    """
    a, b = bounds
    shapes = model.shapes(in_shape)
    back_propagation = sum(layer_costs(local, shapes[a]))
    if optional and 2 * math.prod(shapes[a]) * math.prod(shapes[b]) > back_propagation:
        stats["relayed"] = True
        return None
    budget = model.memory_budget if model.memory_budget is not None else default_memory_budget()
    try:
        planned = SliceProduct(local.layers, shapes[a], budget,
                               CHAIN_PRODUCT_FACTOR * back_propagation if optional else None)
    except ScanCostError:
        stats["relayed"] = True
        return None
    except PlanBudgetError as error:
        raise MemoryError(f"rank {stats['rank']}: the product of layers {a}..{b - 1} needs more than "
                          f"{error.needed} bytes, over the memory budget of {error.budget} (use "
                          "combine='relay', which forms no slice products)") from None
    product = planned.compute(local.transposed_jacobians())
    stats.update(product_flops=planned.flops, product_nnz=planned.nnz, product_bytes=product.nbytes)
    return product


def _exscan(channel: Channel, mine: Any) -> Any:
    """The exclusive scan of the ranks' contributions in reverse rank order, under ``◇``.

    Recursive doubling over the channel's polled messages (``ceil(log2 P)`` rounds, mpi4py's own
    algorithm for an object ``exscan``), so that a wait can time out and device arrays move by the
    transport. Returns None on the last rank (nothing comes before it).
    """
    rank = channel.size - 1 - channel.rank  # the scan's order: the last rank first
    result, partial, mask, rounds = None, mine, 1, 0
    while mask < channel.size:
        target = rank ^ mask
        if target < channel.size:
            other = channel.size - 1 - target
            channel.send(partial, other, TAG_EXSCAN + rounds, "a partial scan")
            received = channel.recv(other, TAG_EXSCAN + rounds, "a partial scan")
            if rank > target:
                partial = _op(received, partial)
                result = received if result is None else _op(received, result)
            else:
                partial = _op(partial, received)
        mask <<= 1
        rounds += 1
    return result


def _gather(channel: Channel, result: DistributedResult) -> None:
    """Rank 0 collects every slice's gradients, parameter gradients and stats."""
    rank, last = channel.rank, channel.size - 1
    if rank > 0:
        own = result.grads if rank == last else result.grads[:-1]  # x_b's gradient: the next rank's
        channel.send((own, result.parameters, result.stats), 0, TAG_GATHER, "its gradients")
        return
    grads, ranks = list(result.grads[:-1] if last > 0 else result.grads), [dict(result.stats)]
    for source in range(1, last + 1):
        own, parameters, stats = channel.recv(source, TAG_GATHER, "gradients")
        grads.extend(own)
        result.parameters.update(parameters)
        ranks.append(stats)
    result.grads = grads
    result.stats["ranks"] = ranks
