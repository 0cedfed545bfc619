"""PyTorch's front door: a module's ``forward()`` captured exactly as sparse-scan layers, or refused.

:func:`capture` traces a ``torch.nn.Module``'s forward with torch.fx and turns every node of its graph
into a layer, an inline block (a sum, a concatenation or a product of branches) or a recurrent
classifier's head, checked against the module in float64 (:class:`Capture`: the spec, the module's own
weight tensors, their names); anything it cannot represent exactly is refused with a :class:`CaptureError`
naming the graph node and the line of the forward. :func:`export_torch` writes a capture as a model spec
and its weights (:func:`sparse_scan.load_model` reads them back). :func:`bppsa` wraps a module so that
autograd's backward through it is the scan (:class:`BPPSA`, an ``nn.Module`` over the same parameters):
BPPSA inside your own training loop (docs/torch.md). :class:`PrunedAdam` is ``torch.optim.Adam`` whose
step leaves out the weights a ``torch.nn.utils.prune`` mask prunes (the same trajectory, bit for bit).

PyTorch is imported by these functions when they run, never by ``import sparse_scan``: the engine does
not need it.
"""

from __future__ import annotations

from .._lazy import lazy_attributes

__all__ = ["BPPSA", "Capture", "CaptureError", "PrunedAdam", "Source", "bppsa", "capture", "export_torch"]

_NAMES = {"BPPSA": "_bridge", "Capture": "_capture", "CaptureError": "_graph", "PrunedAdam": "_optim",
          "Source": "_capture", "bppsa": "_bridge", "capture": "_capture", "export_torch": "_export"}

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _NAMES, ())
