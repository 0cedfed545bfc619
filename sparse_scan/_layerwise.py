"""Back-propagation layer by layer, outside the scan engine: what ``sparse-scan run --check`` compares
the linear scan with.

Each layer's transposed Jacobian at the last forward (its values, ``Layer.transposed_jacobian``; a
residual block's the sum of its chains' products) is applied by SciPy on the host, one layer after the
other: no plan, no executor, none of the operators through a layer's weights or input that the scans
use for their matrix-vector steps. So the engine's linear scan, which runs those operators, is
checked against a different computation.

Examples
--------
>>> import numpy as np
>>> from sparse_scan import Sequential
>>> from sparse_scan.layers import Conv2d, Flatten, Linear, ReLU
>>> model = Sequential(Conv2d(1, 2, 3, dtype=np.float64, rng=0), ReLU(), Flatten(),
...                    Linear(2 * 4 * 4, 3, dtype=np.float64, rng=1))
>>> y = model.forward(np.random.default_rng(0).standard_normal((5, 1, 6, 6)))
>>> grads = layerwise_backward(model, np.ones_like(y))
>>> scan = model.backward(np.ones_like(y), method="linear")
>>> all(np.allclose(a, b.reshape(5, -1)) for a, b in zip(grads, scan, strict=True))
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import backend as _backend
from ._types import Array

__all__ = ["layerwise_backward"]


def layerwise_backward(model: Any, grad_out: Array) -> list[np.ndarray]:
    """Gradients w.r.t. ``x_0 .. x_n`` of the last forward, by ``g_{i-1} = JT_i @ g_i`` with SciPy.

    Parameters
    ----------
    model : Sequential
        After a forward pass.
    grad_out : array, shape (B, *out_shape)
        Gradient w.r.t. the output (host or GPU).

    Returns
    -------
    list of ndarray
        Host arrays ``(B, size of x_i)``, ``i = 0 .. n``. A JT shared by the batch is one SciPy
        matrix times every sample's gradient; a per-sample one, one product per sample.
    """
    g = _backend.of(grad_out).to_host(grad_out)
    batch = g.shape[0]
    grads = [g.reshape(batch, -1)]
    for jt in reversed(model.transposed_jacobians()):
        g = grads[-1]
        if jt.shared:
            grads.append(np.asarray(jt.to_scipy() @ g.T).T)
        else:
            grads.append(np.stack([jt.to_scipy(sample) @ g[sample] for sample in range(batch)]))
    return grads[::-1]
