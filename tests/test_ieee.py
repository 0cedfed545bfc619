"""IEEE semantics against PyTorch (issue 47 item 2): every layer of :mod:`sparse_scan.layers` on inputs
holding +inf, -inf, NaN, -0.0, +0.0 and subnormal values, in float32 and float64, against autograd.

Per layer: (a) the forward output: NaN where PyTorch's is NaN, the same infinities, the sign of a zero;
(b) the input gradient ``JT @ g`` of a finite ``g``, each way the engine computes it: JT's values by
SciPy's SpMV, the layer's operator from its input (``input_matvec``) where it has one, and a tiny chain's
``Sequential.backward`` by the linear and the Blelloch scans; (c) the parameter gradients, a pruned
Conv2d's and Linear's being autograd's times the mask (``torch.nn.utils.prune``'s ``weight_orig``).
Where PyTorch's result is NaN ours is NaN, where it is infinite ours is the same infinity, where it is
finite ours equals it (float64: 1e-12 relative). Last, the bridge: ``bppsa`` on an input holding an
infinity equals autograd (outputs, input gradient, parameter gradients).

Three places where PyTorch itself gives no single answer are left out, each depending on which of its
loops reaches the element (the vectorised body or the scalar tail, by its position in the tensor):
ELU's, Hardtanh's and Hardswish's gradient at a NaN input (NaN, 0 and NaN in the body, the gradient in
the tail), and
float32 GELU(inf) (NaN in the body, inf in the tail and in float64). And a LayerNorm's groups whose
squares overflow the dtype (float32's 1e30): PyTorch's vectorised moments make their variance infinite
or NaN by the group's length. And a bilinear upsampling's zero and subnormal outputs: PyTorch's compiled
loops fuse its products into their sums (FMA) by the vector width, so the sign and the rounding of an
output whose products underflow are its loop's.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import masked, torch_mirror

from sparse_scan import Sequential, layers
from sparse_scan.layers import (
    ELU,
    GELU,
    AdaptiveAvgPool2d,
    Affine,
    AvgPool2d,
    BatchNorm2d,
    Block,
    ChannelShuffle,
    Conv2d,
    Dropout,
    DropPath,
    Flatten,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    Identity,
    LayerNorm,
    LayerScale,
    LeakyReLU,
    Linear,
    LogSoftmax,
    MaxPool2d,
    Mish,
    Narrow,
    ReLU,
    Residual,
    Sigmoid,
    SiLU,
    Softmax,
    Softplus,
    StochasticDepth,
    Tanh,
    Upsample,
)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's on inf - inf, inf * 0, ...

DTYPES = [np.float32, np.float64]
TOLERANCE = {np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-12}
"""Relative tolerance of finite results; float32 results of sums differ from PyTorch's by their order."""
PLANE, FLAT = (2, 4, 6), (12,)


def batch_norm(channels: int, dtype) -> BatchNorm2d:
    """A frozen batch norm with random statistics, one channel's weight zero (``inf * 0``)."""
    rng = np.random.default_rng(channels)
    layer = BatchNorm2d(channels, dtype=dtype).eval()
    layer.running_mean = rng.standard_normal(channels).astype(dtype)
    layer.running_var = rng.uniform(0.5, 2.0, channels).astype(dtype)
    layer.weight = np.where(np.arange(channels) == 0, 0, rng.uniform(0.5, 1.5, channels)).astype(dtype)
    layer.bias = rng.standard_normal(channels).astype(dtype)
    return layer


def with_parameters(layer):
    """``layer`` with random parameters, the first entry of each but a bias zero (``inf * 0``)."""
    rng = np.random.default_rng(7)
    for name in layer.parameter_names:
        value = getattr(layer, name)
        if value is not None:
            random = rng.uniform(0.5, 1.5, value.shape)
            if name != "bias":
                random.flat[0] = 0.0
            setattr(layer, name, random.astype(value.dtype))
    return layer


CASES = {  # id: (layer factory of the dtype, per-sample input shape)
    "conv": (lambda d: Conv2d(2, 3, 3, padding=1, dtype=d, rng=1), PLANE),
    "conv-strided-grouped": (
        lambda d: Conv2d(2, 4, (2, 3), stride=2, padding=(1, 0), groups=2, dtype=d, rng=2), PLANE),
    "linear": (lambda d: Linear(12, 5, dtype=d, rng=3), FLAT),
    "relu": (lambda d: ReLU(), PLANE),
    "leaky-relu": (lambda d: LeakyReLU(0.1), PLANE),
    "leaky-relu-0": (lambda d: LeakyReLU(0.0), PLANE),
    "tanh": (lambda d: Tanh(), PLANE),
    "sigmoid": (lambda d: Sigmoid(), PLANE),
    "gelu": (lambda d: GELU(), PLANE),
    "gelu-tanh": (lambda d: GELU("tanh"), PLANE),
    "silu": (lambda d: SiLU(), PLANE),
    "elu": (lambda d: ELU(0.7), PLANE),
    "hardtanh": (lambda d: Hardtanh(-0.5, 0.8), PLANE),
    "softplus": (lambda d: Softplus(), PLANE),
    "softplus-2-3": (lambda d: Softplus(2.0, 3.0), PLANE),
    "hardswish": (lambda d: Hardswish(), PLANE),
    "hardsigmoid": (lambda d: Hardsigmoid(), PLANE),
    "mish": (lambda d: Mish(), PLANE),
    "identity": (lambda d: Identity(), PLANE),
    "affine": (lambda d: Affine(scale=-2.0, shift=1.0), PLANE),
    "affine-shift": (lambda d: Affine(shift=0.5), PLANE),
    "max-pool-2": (lambda d: MaxPool2d(2), PLANE),
    "max-pool-2-odd": (lambda d: MaxPool2d(2), (2, 5, 7)),
    "max-pool-3-2-1": (lambda d: MaxPool2d(3, 2, 1), PLANE),
    "max-pool-dilated-ceil": (lambda d: MaxPool2d((2, 3), stride=(1, 2), dilation=(2, 1), ceil_mode=True),
                              PLANE),
    "avg-pool-2": (lambda d: AvgPool2d(2), PLANE),
    "avg-pool-3-2-1": (lambda d: AvgPool2d(3, 2, 1, count_include_pad=False), PLANE),
    "avg-pool-ceil": (lambda d: AvgPool2d(2, ceil_mode=True), (2, 5, 7)),
    "adaptive-avg-pool": (lambda d: AdaptiveAvgPool2d((3, 4)), PLANE),
    "adaptive-avg-pool-1": (lambda d: AdaptiveAvgPool2d(1), PLANE),
    "adaptive-avg-pool-none": (lambda d: AdaptiveAvgPool2d((3, None)), PLANE),
    "batch-norm": (lambda d: batch_norm(2, d), PLANE),
    "layer-norm": (lambda d: with_parameters(LayerNorm(6, dtype=d)), PLANE),
    "layer-norm-2d-plain": (lambda d: LayerNorm((4, 6), elementwise_affine=False, dtype=d), PLANE),
    "layer-norm-flat": (lambda d: with_parameters(LayerNorm(12, bias=False, dtype=d)), FLAT),
    "layer-norm-channels": (lambda d: with_parameters(LayerNorm(2, 1e-6, data_format="channels_first",
                                                                dtype=d)), PLANE),
    "layer-scale": (lambda d: with_parameters(LayerScale(2, dtype=d)), PLANE),
    "upsample-nearest": (lambda d: Upsample(scale_factor=2), PLANE),
    "upsample-nearest-exact": (lambda d: Upsample(size=(5, 9), mode="nearest-exact"), PLANE),
    "upsample-bilinear": (lambda d: Upsample(scale_factor=1.5, mode="bilinear"), PLANE),
    "upsample-bilinear-corners": (lambda d: Upsample(size=(7, 4), mode="bilinear", align_corners=True),
                                  PLANE),
    "upsample-bilinear-copy": (lambda d: Upsample(size=(4, 3), mode="bilinear"), PLANE),
    "dropout-eval": (lambda d: Dropout(0.3).eval(), PLANE),
    "stochastic-depth-eval": (lambda d: StochasticDepth(0.3, "row").eval(), PLANE),
    "drop-path-eval": (lambda d: DropPath(0.3).eval(), FLAT),
    "flatten": (lambda d: Flatten(), PLANE),
    "narrow": (lambda d: Narrow(1, 1), PLANE),
    "narrow-plane": (lambda d: Narrow(2, 2), (4, 4, 6)),
    "channel-shuffle": (lambda d: ChannelShuffle(2), (4, 4, 6)),
    "log-softmax": (lambda d: LogSoftmax(dim=1), FLAT),
    "softmax": (lambda d: Softmax(dim=-1), FLAT),
    "residual": (lambda d: Residual(Conv2d(2, 2, 3, padding=1, dtype=d, rng=4), ReLU(),
                                    Conv2d(2, 2, 3, padding=1, dtype=d, rng=5)), PLANE),
    "residual-shortcut": (lambda d: Residual(Conv2d(2, 3, 3, stride=2, padding=1, bias=False, dtype=d, rng=6),
                                             batch_norm(3, d), ReLU(),
                                             shortcut=[Conv2d(2, 3, 1, stride=2, bias=False, dtype=d, rng=7),
                                                       batch_norm(3, d)]), PLANE),
    "block-concat": (lambda d: Block([Conv2d(2, 3, 1, dtype=d, rng=11)],
                                     [Conv2d(2, 2, 3, padding=1, dtype=d, rng=12), ReLU()], [],
                                     join="concat"),
                     PLANE),
    "block-product": (lambda d: Block([], [AdaptiveAvgPool2d(1), Conv2d(2, 1, 1, dtype=d, rng=13), ReLU(),
                                           Conv2d(1, 2, 1, dtype=d, rng=14), Sigmoid()],
                                      join="product", names=[None, None]), PLANE),
    "block-sum": (lambda d: Block([Conv2d(2, 2, 3, padding=1, dtype=d, rng=15), Hardswish()], [],
                                  join="sum"), PLANE),
}
WITH_PARAMETERS = [name for name, (factory, _) in CASES.items()
                   if hasattr(factory(np.float64), "parameter_gradients")]


def special_batch(shape: tuple[int, ...], dtype, seed: int = 0) -> np.ndarray:
    """Six samples of per-sample ``shape``, normal values around the special ones: 0 finite, with
    exact zeros; 1 +inf and -inf; 2 NaN (two in one 2x2 window, others at each corner of one); 3 signed
    zeros and subnormals only (windows of tied zeros); 4 all of them with magnitudes that overflow
    products (``1e30 ** 2`` in float32); 5 an infinity and a NaN in the same window."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6,) + shape).astype(dtype)
    flat = x.reshape(6, -1)
    n = flat.shape[1]
    tiny = np.finfo(dtype).smallest_subnormal
    flat[0, ::5] = 0.0
    flat[1, n // 3], flat[1, 2 * n // 3] = np.inf, -np.inf
    flat[3, ::2], flat[3, 1::4], flat[3, 3::8], flat[3, 7::8] = -0.0, 0.0, 3 * tiny, -3 * tiny
    if len(shape) == 3:  # (C, H, W): the 2x2 windows' corners
        for c, h, w in ((0, 0, 1), (0, 1, 0), (0, 3, 3), (1, 0, 2), (1, 2, 5), (1, 3, 4)):
            x[2, c, h, w] = np.nan
        x[4, 0, 0, 0], x[4, 0, 0, 1], x[4, 1, 1, 1], x[4, 1, 0, 0] = np.inf, -np.inf, np.nan, -0.0
        x[4, 0, 2, 2], x[4, 0, 3, 3], x[4, 1, 2, 4], x[4, 1, 3, 2] = 60.0, -60.0, 1e30, -1e30
        x[5, 0, 1, 1], x[5, 0, 0, 0], x[5, 1, 2, 2], x[5, 1, 3, 3] = np.inf, np.nan, -np.inf, np.nan
    else:
        flat[2, [1, 7]] = np.nan
        flat[4, [0, 1, 2, 3, 5, 8, 9, 11]] = [np.inf, -np.inf, np.nan, -0.0, 60.0, -60.0, 1e30, -1e30]
        flat[5, [3, 4]] = [np.inf, np.nan]
    return x


def finite_gradient(shape: tuple[int, ...], dtype, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def assert_ieee_equal(ours, theirs, what: str, signs: bool = False, ignore=None) -> None:
    """NaN where ``theirs`` is NaN, the same infinities, finite values within the dtype's tolerance
    (relative, and as much of the largest finite magnitude); ``signs``: a zero's sign too (where both
    are zero). ``ignore``: positions left out."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (what, ours.dtype, theirs.dtype)
    rtol = TOLERANCE[ours.dtype]
    if ignore is not None:
        ours, theirs = ours[~ignore], theirs[~ignore]
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan), f"{what}: NaN at {np.argwhere(np.isnan(ours) != nan)[:8]}"
    infinite = np.isinf(theirs)
    assert np.array_equal(ours[infinite], theirs[infinite]) and not np.isinf(ours[~infinite]).any(), (
        f"{what}: infinities differ at {np.argwhere(np.isinf(ours) != infinite)[:8]}")
    finite = ~nan & ~infinite
    scale = float(np.abs(theirs[finite]).max(initial=1.0))
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=rtol, atol=rtol * scale, err_msg=what)
    if signs:
        zeros = (theirs == 0) & (ours == 0)
        assert np.array_equal(np.signbit(ours[zeros]), np.signbit(theirs[zeros])), f"{what}: signs of zeros"


def mirror(layer, x: np.ndarray):
    """The PyTorch module computing what ``layer`` computed at its last forward, whose input had the
    shape and dtype of ``x``: a dropout in training mode multiplies by that forward's mask."""
    if isinstance(layer, (Dropout, StochasticDepth, DropPath)) and layer.training:
        data = layer.transposed_jacobian(x).data  # (n,) for a batch's one mask
        return masked(np.array(np.broadcast_to(data, (len(x), data.shape[-1]))).reshape(x.shape))
    if isinstance(layer, Narrow):  # torch.narrow of the channels
        return Narrowed(layer.start, layer.length)
    if isinstance(layer, ChannelShuffle):
        return torch.nn.ChannelShuffle(layer.groups)
    return torch_mirror(layer, getattr(torch, np.dtype(x.dtype).name))


class Narrowed(torch.nn.Module):
    """``torch.narrow(x, 1, start, length)``: a Narrow layer's channels."""

    def __init__(self, start: int, length: int) -> None:
        super().__init__()
        self.start, self.length = start, length

    def forward(self, x):
        return torch.narrow(x, 1, self.start, self.length)


def autograd(module, x: np.ndarray, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """``module``'s output at ``x``, and by autograd the input gradient and every parameter's for the
    output gradient ``grad``."""
    tx = torch.from_numpy(x.copy()).requires_grad_(True)
    y = module(tx)
    y.backward(torch.from_numpy(grad).reshape(y.shape))
    return (y.detach().numpy(), tx.grad.numpy(),
            {name: p.grad.numpy() for name, p in module.named_parameters() if p.grad is not None})


def unspecified(layer, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Where PyTorch's forward and input gradient have no single answer (the module docstring)."""
    exact_gelu = isinstance(layer, GELU) and layer.approximate == "none" and x.dtype == np.float32
    overflow = overflowing_groups(layer, x) if isinstance(layer, LayerNorm) else None
    if isinstance(layer, Upsample) and layer.mode == "bilinear":  # outputs of underflowing products
        return np.abs(layer.forward(x)) < np.finfo(x.dtype).tiny, None
    return (np.isposinf(x) if exact_gelu else overflow,
            np.isnan(x) if isinstance(layer, (ELU, Hardtanh, Hardswish)) else overflow)


def overflowing_groups(layer: LayerNorm, x: np.ndarray) -> np.ndarray:
    """Where a LayerNorm's group holds a finite value whose square, times the group's length, overflows
    the dtype (the module docstring)."""
    groups, n, positions = layer._layout(x.shape[1:])
    grouped = np.abs(x.astype(np.float64)).reshape(len(x), groups, n, positions)
    largest = np.where(np.isfinite(grouped), grouped, 0).max(axis=2, keepdims=True)
    overflow = largest * largest * n > np.finfo(x.dtype).max
    return np.broadcast_to(overflow, grouped.shape).reshape(x.shape)


def check_layer(layer, x: np.ndarray) -> None:
    """(a) forward and (b) the input gradient from JT's values and from the input, against autograd."""
    y = layer.forward(x)
    out, dx, _ = autograd(mirror(layer, x), x, finite_gradient(y.shape, x.dtype))
    forward, ignore = unspecified(layer, x)
    assert_ieee_equal(y, out, "forward", signs=True, ignore=forward)
    grad = finite_gradient(y.shape, x.dtype).reshape(x.shape[0], -1)
    jt = layer.transposed_jacobian(x)
    by_values = np.stack([jt.to_scipy(sample=b) @ grad[b] for b in range(x.shape[0])])
    assert_ieee_equal(by_values.reshape(x.shape), dx, "JT's values @ g", ignore=ignore)
    operator = layer.input_matvec(x)
    if operator is not None:
        assert_ieee_equal(operator(grad).reshape(x.shape), dx, "input_matvec", ignore=ignore)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_input_gradient_equal_autograd(case, dtype):
    factory, shape = CASES[case]
    check_layer(factory(dtype), special_batch(shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", ["linear", "blelloch"])
def test_a_chains_scan_equals_autograd(case, dtype, method):
    """``Identity -> layer -> Affine`` by ``Sequential.backward``: every gradient the scan gives and the
    parameter gradients from them."""
    factory, shape = CASES[case]
    model = Sequential(Identity(), factory(dtype), Affine(scale=0.5))
    x = special_batch(shape, dtype, seed=2)
    y = model.forward(x)
    grad = finite_gradient(y.shape, dtype)
    grads = model.backward(grad, method)
    net = torch.nn.Sequential(*[mirror(layer, a) for layer, a in zip(model.layers, (x, x, y), strict=True)])
    out, dx, parameters = autograd(net, x, grad)
    forward, ignore = unspecified(model.layers[1], x)
    assert_ieee_equal(y, out, "forward", signs=True, ignore=forward)
    assert_ieee_equal(grads[0], dx, f"{method} scan: input gradient", ignore=ignore)
    ours = model.parameter_gradients(grads)
    assert sorted(ours) == sorted(parameters)
    for name, value in ours.items():
        assert_ieee_equal(value, parameters[name], f"{method} scan: {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", WITH_PARAMETERS)
def test_parameter_gradients_equal_autograd(case, dtype):
    factory, shape = CASES[case]
    layer = factory(dtype)
    x = special_batch(shape, dtype, seed=3)
    grad = finite_gradient(layer.forward(x).shape, dtype)
    _, _, parameters = autograd(mirror(layer, x), x, grad)
    ours = layer.parameter_gradients(x, grad)
    assert sorted(ours) == sorted(parameters)
    for name, value in ours.items():
        assert_ieee_equal(value, parameters[name], name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.4, 1.0])
def test_dropout_in_training_mode_multiplies_by_its_mask(dtype, p):
    """PyTorch's dropout multiplies by its mask: a dropped infinity is NaN (``inf * 0``)."""
    layer = Dropout(p, rng=0)
    check_layer(layer, special_batch(PLANE, dtype))
    model = Sequential(Identity(), Dropout(p, rng=1), Affine(scale=0.5))
    x = special_batch(PLANE, dtype, seed=2)
    y = model.forward(x)
    grad = finite_gradient(y.shape, dtype)
    net = torch.nn.Sequential(*[mirror(layer, a) for layer, a in zip(model.layers, (x, x, y), strict=True)])
    out, dx, _ = autograd(net, x, grad)
    assert_ieee_equal(y, out, "forward", signs=True)
    for method in ("linear", "blelloch"):
        assert_ieee_equal(model.backward(grad, method)[0], dx, method)


SAMPLE_DROPS = {"row": lambda: StochasticDepth(0.5, "row", rng=3),
                "batch": lambda: StochasticDepth(0.5, "batch"),
                "drop-all": lambda: DropPath(1.0), "unscaled": lambda: DropPath(0.5, False, rng=5)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(SAMPLE_DROPS))
def test_sample_drops_in_training_mode_multiply_by_their_masks(case, dtype):
    """StochasticDepth and DropPath multiply by their masks, as PyTorch's: a dropped infinity is NaN."""
    check_layer(SAMPLE_DROPS[case](), special_batch(PLANE, dtype))
    model = Sequential(Identity(), SAMPLE_DROPS[case](), Affine(scale=0.5))
    x = special_batch(PLANE, dtype, seed=2)
    y = model.forward(x)
    grad = finite_gradient(y.shape, dtype)
    net = torch.nn.Sequential(*[mirror(layer, a) for layer, a in zip(model.layers, (x, x, y), strict=True)])
    out, dx, _ = autograd(net, x, grad)
    assert_ieee_equal(y, out, "forward", signs=True)
    for method in ("linear", "blelloch"):
        assert_ieee_equal(model.backward(grad, method)[0], dx, method)


def pruned(kind: str, dtype) -> Conv2d | Linear:
    """A Conv2d or Linear of ``prune_pattern=True`` keeping a tenth of its weights (the sparse products'
    share), with its PyTorch mask."""
    layer = (Conv2d(2, 4, 3, padding=1, prune_pattern=True, dtype=dtype, rng=8) if kind == "conv"
             else Linear(48, 6, prune_pattern=True, dtype=dtype, rng=9))
    keep = np.random.default_rng(10).random(layer.weight.shape) < 0.1
    layer.weight = np.where(keep, layer.weight, 0).astype(dtype)
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_a_pruned_layer_gives_autograds_gradients_times_the_mask(kind, dtype):
    """Finite batches: exactly zero at the pruned weights; batches with infinities or NaN: autograd's
    gradient of ``weight_orig`` through ``weight_orig * mask`` (NaN where ``inf * 0``)."""
    layer = pruned(kind, dtype)
    x = special_batch((2, 4, 6), dtype, seed=4)
    if kind == "linear":
        x = x.reshape(x.shape[0], -1)
    mask = torch.from_numpy((layer.weight != 0).astype(dtype))
    for batch in (x[:1], x):  # sample 0 alone is finite
        y = layer.forward(batch)
        grad = finite_gradient(y.shape, dtype)
        out, dx, parameters = autograd(mirror(layer, batch), batch, grad)
        assert_ieee_equal(y, out, "forward", signs=True)
        jt = layer.transposed_jacobian(batch)
        assert_ieee_equal(np.stack([jt.to_scipy(sample=b) @ grad.reshape(len(batch), -1)[b]
                                    for b in range(len(batch))]).reshape(batch.shape), dx, "JT @ g")
        ours = layer.parameter_gradients(batch, grad)
        assert_ieee_equal(ours["weight"], parameters["weight"] * mask.numpy(), "weight")
        assert_ieee_equal(ours["bias"], parameters["bias"], "bias")
        if len(batch) == 1:
            assert not ours["weight"][~(layer.weight != 0)].any()


def test_every_layer_is_covered():
    covered = {type(factory(np.float64)).__name__ for factory, _ in CASES.values()}
    assert covered == set(layers.__all__) - {"Layer"}


# --- the GPU twins: what the host computes --------------------------------------------------------
GPU_CASES = ["relu", "elu", "max-pool-2", "max-pool-2-odd", "max-pool-3-2-1", "max-pool-dilated-ceil",
             "avg-pool-2", "avg-pool-3-2-1", "adaptive-avg-pool", "adaptive-avg-pool-1",
             "hardswish", "mish", "layer-norm", "layer-norm-channels", "layer-scale", "upsample-nearest",
             "upsample-bilinear", "upsample-bilinear-corners", "narrow-plane", "channel-shuffle"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GPU_CASES)
def test_the_gpu_gives_the_hosts_ieee_results(case, dtype):
    from sparse_scan import backend

    gpu = backend.get("gpu")
    factory, shape = CASES[case]
    x = special_batch(shape, dtype)
    host, device = factory(dtype), factory(dtype)
    assert_ieee_equal(gpu.to_host(device.forward(gpu.asarray(x))), host.forward(x), "forward", signs=True)
    got = device.transposed_jacobian(gpu.asarray(x))
    want = host.transposed_jacobian(x)
    assert_ieee_equal(gpu.to_host(got.data), want.data, "JT's values")


# --- the bridge -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["linear", "blelloch"])
def test_the_bridge_on_an_infinite_input_equals_autograd(method):
    """The issue's case: a conv -> relu -> linear net, one input +inf in a corner (in one window). A
    channel whose weight there is negative gives -inf, which ReLU makes 0 (not ``-inf * 0``): the
    outputs are infinite, not NaN, and so are as many parameter gradients as autograd's."""
    from sparse_scan.torch import bppsa

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(2 * 4 * 4, 3)).double()
    with torch.no_grad():
        net[0].weight[:, 0, 0, 0] = torch.tensor([-0.5, 0.5])
    x = torch.randn(2, 1, 6, 6, dtype=torch.float64)
    x[0, 0, 0, 0] = float("inf")
    results = []
    for module in (bppsa(net, method), net):
        net.zero_grad()
        tx = x.clone().requires_grad_(True)
        y = module(tx)
        y.backward(torch.arange(6, dtype=torch.float64).reshape(2, 3) - 2.5)
        results.append([y.detach().numpy(), tx.grad.numpy()]
                       + [p.grad.numpy().copy() for p in net.parameters()])
    ours, expected = results
    assert np.isinf(expected[0][0]).all() and not np.isnan(expected[0]).any()
    for name, a, b in zip(["output", "input gradient", "conv weight", "conv bias", "linear weight",
                           "linear bias"], ours, expected, strict=True):
        assert_ieee_equal(a, b, name)
