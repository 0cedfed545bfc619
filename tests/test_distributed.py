"""The scan across MPI processes: equal to one process (float64, 1e-10), splits, and failures.

The MPI tests launch ``mpirun -n 2`` and ``-n 3`` (loopback) as subprocesses with a timeout; they skip
only where mpi4py or a launcher is missing (``pip install '.[mpi]'``, in the test extra, installs both),
and fail instead where ``SPARSE_SCAN_REQUIRE_MPI`` is set (CI, ``make test-mpi``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner
from mpi_worker import BATCH, inputs, load, random_chain

from sparse_scan import distributed, load_model
from sparse_scan.cli import _distributed as cli_distributed
from sparse_scan.cli import app
from sparse_scan.distributed import _mpi
from sparse_scan.distributed._slices import SliceProduct, apply, combine

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
WORKER = pathlib.Path(__file__).with_name("mpi_worker.py")
LIMIT_S = 180
"""Seconds any mpirun may take: 20x the slowest test here measured with both cores of a 2-core machine
busy with another job (8.9 s; 4.6 s quiet)."""


def _launcher() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return None
    try:
        return distributed.launcher()
    except distributed.MPIUnavailableError:
        return None


MPIEXEC = _launcher()
MISSING = "mpi4py or an MPI launcher (mpiexec) is not installed: pip install '.[mpi]'"
if MPIEXEC is None and os.environ.get("SPARSE_SCAN_REQUIRE_MPI"):  # CI: the MPI tests must run
    raise RuntimeError(f"SPARSE_SCAN_REQUIRE_MPI is set but {MISSING}")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason=MISSING)


def mpirun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run([MPIEXEC, "-n", str(ranks), *args], capture_output=True, text=True,
                          timeout=LIMIT_S, env=env, cwd=ROOT)


def single_process(model):
    x, grad = inputs(model)
    model.forward(x)
    grads = model.backward(grad, "linear")
    return grads, model.parameter_gradients(grads)


# --- without MPI: splits and slice products ---------------------------------------------------------
@pytest.mark.parametrize("costs, parts, expected", [
    ([1, 1, 1, 1], 2, [2, 2]), ([10, 1, 1, 10], 2, [2, 2]), ([5, 1, 1, 1, 1, 1], 2, [1, 5]),
    ([3, 3, 3], 3, [1, 1, 1]), ([1, 2, 3], 1, [3]), ([0.5, 0.25, 0.25, 1.0], 3, [2, 1, 1]),
    ([7] * 10, 4, [2, 3, 2, 3])])
def test_balanced_split(costs, parts, expected):
    assert distributed.balanced_split(costs, parts) == expected


def test_balanced_split_minimises_the_costliest_part():
    rng = np.random.default_rng(0)
    for _ in range(50):
        costs = rng.integers(1, 100, int(rng.integers(3, 9))).tolist()
        parts = int(rng.integers(1, len(costs) + 1))
        counts = distributed.balanced_split(costs, parts)
        ends = np.cumsum([0] + counts)
        worst = max(sum(costs[a:b]) for a, b in zip(ends[:-1], ends[1:], strict=True))
        assert len(counts) == parts and min(counts) >= 1 and worst == _worst(costs, parts, 0)


def _worst(costs, parts, start):
    """Brute force: the smallest costliest part over every split of costs[start:] into parts."""
    rest = costs[start:]
    if parts == 1:
        return sum(rest)
    return min(max(sum(rest[:k]), _worst(costs, parts - 1, start + k))
               for k in range(1, len(rest) - parts + 2))


def test_layer_costs_are_the_linear_plans_figures():
    model = load_model(DATA / "lenet5.yaml")
    costs = distributed.layer_costs(model, model.input_shape)
    assert sum(costs) == model.plan(model.input_shape, "linear").work_flops
    assert costs == [2 * layer.pattern(shape).nnz
                     for layer, shape in zip(model.layers, model.shapes(model.input_shape), strict=False)]


def test_slices_errors():
    model = load_model(DATA / "tiny.yaml")
    assert distributed.slices(model, 3, [2, 2, 3]) == [(0, 2), (2, 4), (4, 7)]
    with pytest.raises(ValueError, match="8 ranks but the model has 7 layers"):
        distributed.slices(model, 8, None, model.input_shape)
    with pytest.raises(ValueError, match=r"split \[2, 2\] must give 3 positive layer counts"):
        distributed.slices(model, 3, [2, 2])
    with pytest.raises(ValueError, match="summing to the model's 7 layers"):
        distributed.slices(model, 2, [3, 3])


@pytest.mark.parametrize("seed", range(4))
def test_slice_products_chain_like_back_propagation(seed):
    model = random_chain(seed)
    grads, _ = single_process(model)
    jacobians = model.transposed_jacobians()
    shapes = model.shapes(model.input_shape)
    n = len(model)
    for a, b in [(0, n), (1, n - 1), (0, 1), (n // 2, n)]:
        product = SliceProduct(model.layers[a:b], shapes[a]).compute(jacobians[a:b])
        got = apply(product, grads[b].reshape(BATCH, -1))
        np.testing.assert_allclose(got, grads[a].reshape(BATCH, -1), rtol=1e-10, atol=1e-12)
    # the exscan operator: (S_2 ◇ S_1) applied = S_1 · S_2 applied
    middle = n // 2
    first = SliceProduct(model.layers[:middle], shapes[0]).compute(jacobians[:middle])
    second = SliceProduct(model.layers[middle:], shapes[middle]).compute(jacobians[middle:])
    both = distributed._op(second, first)
    assert both.shape == (int(np.prod(shapes[0])), int(np.prod(shapes[-1])))
    np.testing.assert_allclose(apply(combine(first, second), grads[n].reshape(BATCH, -1)),
                               grads[0].reshape(BATCH, -1), rtol=1e-10, atol=1e-12)
    vector = distributed._op(grads[n].reshape(BATCH, -1), both)
    np.testing.assert_allclose(vector, grads[0].reshape(BATCH, -1), rtol=1e-10, atol=1e-12)


def test_abort_flushes_and_waits_before_ending_the_job(capsys):
    """What was printed before MPI_Abort gets ``grace`` seconds to reach the launcher."""
    events: list = []

    class Comm:
        def Abort(self, code):  # noqa: N802 - mpi4py's name
            events.append((code, time.monotonic() - start, capsys.readouterr().err))

    print("rank 0: stuck", file=sys.stderr, end="")
    start = time.monotonic()
    distributed.abort(Comm(), 3, grace=0.2)
    assert len(events) == 1 and events[0][0] == 3 and events[0][1] >= 0.2 and events[0][2] == "rank 0: stuck"


def test_cli_needs_a_launcher_or_mpi4py(monkeypatch):
    for name in _mpi.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    result = CliRunner().invoke(app.main, ["run", str(DATA / "tiny.yaml"), "--random", "2", "--distributed"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert "no MPI launcher (mpiexec or mpirun)" in result.output and "sparse-scan[mpi]" in result.output
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    result = CliRunner().invoke(app.main, ["run", str(DATA / "tiny.yaml"), "--random", "2", "--distributed"])
    assert result.exit_code == 2
    assert result.output.startswith("sparse-scan: error: --distributed: mpi4py is not usable")


def test_cli_distributed_options_need_distributed():
    result = CliRunner().invoke(app.main, ["run", str(DATA / "tiny.yaml"), "--random", "2", "--split", "3,4"])
    assert result.exit_code == 2
    assert "--split, --combine, --transport and --gpu-device apply to --distributed only" in result.output
    for option in (["--transport", "staging"], ["--gpu-device", "1"]):
        result = CliRunner().invoke(app.main, ["run", str(DATA / "tiny.yaml"), "--random", "2", *option])
        assert result.exit_code == 2 and "apply to --distributed only" in result.output


# --- under mpirun ---------------------------------------------------------------------------------
def _compare(out, model):
    grads, parameters = single_process(model)
    with np.load(out) as stored:
        got = dict(stored)
    assert sorted(k for k in got if k.startswith("param.")) == sorted(f"param.{k}" for k in parameters)
    for i, expected in enumerate(grads):
        np.testing.assert_allclose(got[f"grad.{i}"], expected, rtol=1e-10, atol=1e-12)
    for name, expected in parameters.items():
        np.testing.assert_allclose(got[f"param.{name}"], expected, rtol=1e-10, atol=1e-12)
    return got


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("model, combine, method", [
    (str(DATA / "tiny.yaml"), "chain", "blelloch"), (str(DATA / "tiny.yaml"), "exscan", "linear"),
    (str(DATA / "lenet5.yaml"), "chain", "blelloch"), (str(DATA / "lenet5.yaml"), "exscan", "blelloch"),
    ("random:0", "chain", "blelloch"), ("random:1", "exscan", "blelloch"), ("random:2", "chain", "linear"),
    ("random:3", "chain", "blelloch"), ("random:4", "relay", "blelloch"), (str(DATA / "lenet5.yaml"), "relay",
                                                                           "linear"),
    ("mlp:0", "chain", "blelloch"), ("mlp:1", "exscan", "linear")])
def test_gradients_equal_one_process(tmp_path, ranks, model, combine, method):
    out = tmp_path / "grads.npz"
    result = mpirun(ranks, sys.executable, str(WORKER), model, str(out), "--combine", combine,
                    "--method", method)
    assert result.returncode == 0, result.stderr
    got = _compare(out, load(model))
    assert len(got["sent_bytes"]) == ranks and got["sent_bytes"].min() > 0
    middle = got["products"][1:-1]
    if combine == "exscan" or model.startswith("mlp"):  # the slice products are formed (and pay)
        assert (middle > 0).all()
    elif combine == "relay" or model.startswith("random"):  # convolutions: the chain relays
        assert (middle == -1).all()


ZOO_SPEC = """\
# issue 46's blocks and layers: a concatenation with the identity, a squeeze-and-excitation product,
# Hardswish, Mish, Hardsigmoid, a channels-first LayerNorm, a layer scale, bilinear upsampling
input_shape: [2, 8, 8]
init: {seed: 0}
layers:
  - {name: stem, type: conv2d, out_channels: 4, kernel_size: 3, padding: 1}
  - {name: act, type: hardswish}
  - name: mixed
    type: block
    join: concat
    branches:
      - [{type: conv2d, out_channels: 2, kernel_size: 1}]
      - [{type: conv2d, out_channels: 2, kernel_size: 3, padding: 1}, {type: mish}]
      - []
  - {name: norm, type: layer_norm, normalized_shape: 8, data_format: channels_first}
  - name: se
    type: block
    join: product
    branch_names: [null, null]
    branches:
      - - {name: avgpool, type: adaptive_avgpool2d, output_size: 1}
        - {name: fc1, type: conv2d, out_channels: 2, kernel_size: 1}
        - {name: activation, type: relu}
        - {name: fc2, type: conv2d, out_channels: 8, kernel_size: 1}
        - {name: scale_activation, type: hardsigmoid}
      - []
  - {name: scale, type: layer_scale, init_values: 0.5}
  - {name: up, type: upsample, scale_factor: 2, mode: bilinear}
  - {name: pool, type: avgpool2d, kernel_size: 4}
  - {name: flat, type: flatten}
  - {name: fc, type: linear, out_features: 5}
"""


@needs_mpi
@pytest.mark.parametrize("ranks, combine, method", [(2, "chain", "blelloch"), (3, "exscan", "linear"),
                                                     (3, "relay", "blelloch")])
def test_blocks_and_the_new_layers_equal_one_process(tmp_path, ranks, combine, method):
    spec = tmp_path / "zoo.yaml"
    spec.write_text(ZOO_SPEC)
    out = tmp_path / "grads.npz"
    result = mpirun(ranks, sys.executable, str(WORKER), str(spec), str(out), "--combine", combine,
                    "--method", method)
    assert result.returncode == 0, result.stderr
    got = _compare(out, load(str(spec)))
    assert {"param.mixed.1.0.weight", "param.se.fc2.weight", "param.norm.weight",
            "param.scale.gamma"} <= set(got)


@needs_mpi
def test_explicit_split_one_layer_per_rank(tmp_path):
    out = tmp_path / "grads.npz"
    result = mpirun(3, sys.executable, str(WORKER), str(DATA / "tiny.yaml"), str(out), "--split", "1,1,5")
    assert result.returncode == 0, result.stderr
    _compare(out, load(str(DATA / "tiny.yaml")))


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_cli_outputs_equal_one_process(tmp_path, ranks):
    spec = DATA / "lenet5.yaml"
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((4, 1, 28, 28)))
    np.save(tmp_path / "y.npy", rng.integers(0, 10, 4))
    common = ["--input", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"), "--dtype", "float64",
              "--json"]
    single = CliRunner().invoke(app.main, ["run", str(spec), *common, "--out", str(tmp_path / "one.npz")],
                                catch_exceptions=False)
    assert single.exit_code == 0, single.output
    result = mpirun(ranks, sys.executable, "-m", "sparse_scan.cli", "run", str(spec), *common,
                    "--distributed", "--check", "--out", str(tmp_path / "many.npz"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # printed once, by rank 0
    assert report["distributed"]["ranks"] == ranks and report["check"]["max_rel_error"] < 1e-10
    assert report["check"]["computed"] == f"{report['method']} on {ranks} MPI ranks"
    assert report["check"]["reference"] == "one process"
    assert report["loss"] == pytest.approx(json.loads(single.output)["loss"], rel=1e-12)
    with np.load(tmp_path / "one.npz") as one, np.load(tmp_path / "many.npz") as many:
        assert list(one) == list(many)
        for key in one:
            np.testing.assert_allclose(many[key], one[key], rtol=1e-10, atol=1e-12, err_msg=key)


@needs_mpi
def test_cli_more_ranks_than_layers(tmp_path):
    spec = tmp_path / "two.yaml"
    spec.write_text("input_shape: [4]\ninit: {seed: 0}\nlayers:\n  - {type: linear, out_features: 3}\n"
                    "  - {type: relu}\n")
    result = mpirun(3, sys.executable, "-m", "sparse_scan.cli", "run", str(spec), "--random", "2",
                    "--distributed")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"sparse-scan: error: {spec}: 3 ranks but the model has 2 layers: each "
                                     "rank needs at least one layer (run with at most 2 ranks)")
    assert result.stdout == ""


@needs_mpi
def test_cli_refuses_a_recurrent_model_on_every_rank():
    """The distributed scan splits a Sequential's layers: sparse_scan.distributed.backward refuses any
    other model (a recurrent one), one line on rank 0, whatever the command line holds."""
    result = mpirun(2, sys.executable, "-m", "sparse_scan.cli", "run", str(DATA / "lstm-bitstream.yaml"),
                    "--random", "2", "--distributed")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (f"sparse-scan: error: {DATA / 'lstm-bitstream.yaml'}: the distributed "
                                     "scan splits the layers of a Sequential, not a RecurrentClassifier "
                                     "(whose scans run in one process)")


@needs_mpi
@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_failed_rank_is_named(tmp_path, failing):
    result = mpirun(3, sys.executable, str(WORKER), str(DATA / "lenet5.yaml"), str(tmp_path / "g.npz"),
                    "--fail-rank", str(failing))
    assert result.returncode != 0
    assert f"rank {failing} failed: RuntimeError: layer" in result.stderr
    assert "broke on purpose" in result.stderr


@needs_mpi
def test_a_stuck_rank_times_out_instead_of_hanging(tmp_path):
    """Rank 1 hangs in its forward; rank 2, waiting on it, gives up after the timeout and names it.

    The worker warms every rank and starts them together (a barrier), so the verdict does not depend
    on the machine's speed: the other waits are for work of milliseconds (over 100x within 3 s), and
    rank 0, which waits two hops for the output, gives up only after 6 s."""
    result = mpirun(3, sys.executable, str(WORKER), str(DATA / "lenet5.yaml"), str(tmp_path / "g.npz"),
                    "--hang-rank", "1", "--timeout", "3")
    assert result.returncode != 0
    assert "rank 2: receiving activations from rank 1 did not complete within 3 s" in result.stderr


def test_cli_timeout_reaches_every_wait(monkeypatch):
    """``run --distributed --timeout S`` hands S to :func:`sparse_scan.distributed.backward`, whose
    waits time out by it (above); no launcher is needed to see it."""
    seen = {}

    class World:
        def Get_rank(self):  # noqa: N802 - mpi4py's name
            return 0

        def Get_size(self):  # noqa: N802
            return 1

    def backward(*args, **kwargs):
        seen["timeout"] = args[8]
        raise distributed.RankTimeoutError("rank 0: stopped by the test", 0)

    monkeypatch.setattr(cli_distributed, "world", World)
    monkeypatch.setattr(distributed, "backward", backward)
    monkeypatch.setattr(distributed, "abort", lambda comm, code: None)
    result = CliRunner().invoke(app.main, ["run", str(DATA / "tiny.yaml"), "--random", "2", "--distributed",
                                           "--timeout", "7.5"])
    assert seen == {"timeout": 7.5}
    assert result.exit_code == 2 and "rank 0: stopped by the test" in result.output
