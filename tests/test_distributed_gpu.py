"""The scan across GPU ranks: equal to one process (float64, 1e-10), the transports, and failures.

Every rank runs its slice on a GPU: here, where none is usable, each rank of ``mpirun -n 2`` and
``-n 3`` runs on the CuPy stand-in (``python -m cupy_standin``, tests/cupy_standin), whose device
arrays move between the ranks by the host-staging transport (plain MPI of pinned buffers) or, where the
test asserts a CUDA-aware MPI (``SPARSE_SCAN_CUDA_AWARE_MPI=1``), by mpi4py from the arrays' own memory
(the stand-in's device memory is the host's, so MPICH reads it as a CUDA-aware MPI reads a device
buffer), or by NCCL where the stand-in is given a device per rank and its NCCL
(``SPARSE_SCAN_STANDIN_DEVICES``, ``SPARSE_SCAN_STANDIN_NCCL``: its ``send``/``recv`` move the bytes by
MPI). On a machine with a GPU the same tests run on it (those that assert a transport the machine may
lack are the stand-in's only). The transport's choice (forced, refused, detected) is tested without MPI
too, from the facts the ranks gather.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import STANDIN
from mpi_worker import load
from test_distributed import DATA, MPIEXEC, ROOT, WORKER, _compare, needs_mpi
from test_gpu_run import read_rows

from sparse_scan import backend, distributed, load_model
from sparse_scan.distributed import _transport
from sparse_scan.distributed._slices import SliceProduct, apply
from sparse_scan.distributed._transport import Rank, TransportUnavailableError, choose, devices

gpu_ranks = pytest.mark.skipif(not (STANDIN or backend.gpu_usable()),
                               reason="no usable GPU, and the CuPy stand-in cannot run here")
"""The mpirun tests: on the stand-in or a GPU. Not marked ``gpu``: their ranks are processes of their own,
which the stand-in's ``gpu`` session (under coverage) would only run a second time."""
LIMIT_S = 240
"""Seconds any mpirun may take: the slowest run here takes 7 s with both cores of a 2-core machine busy
(a stand-in rank compiles its kernels with g++ once, then reads them from its cache)."""
PYTHON = [sys.executable, "-m", "cupy_standin"] if STANDIN else [sys.executable]
"""How a GPU rank starts: through the CuPy stand-in where no GPU is usable."""
TINY, LENET5 = str(DATA / "tiny.yaml"), str(DATA / "lenet5.yaml")
CUDA_AWARE = {"SPARSE_SCAN_CUDA_AWARE_MPI": "1"}
NCCL = {"SPARSE_SCAN_STANDIN_NCCL": "1", "SPARSE_SCAN_STANDIN_DEVICES": "3"}  # a device per rank, and NCCL


def mpirun(ranks: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([MPIEXEC, "-n", str(ranks), *args], capture_output=True, text=True, timeout=LIMIT_S,
                          env=dict(os.environ, PYTHONPATH=path, **(env or {})), cwd=ROOT)


def worker(ranks: int, model: str, out, *args: str, env: dict[str, str] | None = None):
    return mpirun(ranks, *PYTHON, str(WORKER), model, str(out), "--device", "gpu", *args, env=env)


def cli(ranks: int, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return mpirun(ranks, *PYTHON, "-m", "sparse_scan.cli", "run", *args, env=env)


# --- without MPI: the choice of transport ------------------------------------------------------------
def ranks_of(*places, cuda_aware=False, nccl=False, devices_seen=2):
    return [Rank(host, devices_seen, device, cuda_aware, nccl) for host, device in places]


def test_each_rank_takes_its_local_rank_modulo_its_devices_unless_it_asks():
    ranks = ranks_of(("a", None), ("a", None), ("a", None), ("b", None), ("b", 1))
    assert devices(ranks) == [0, 1, 0, 0, 1]


def test_auto_takes_the_first_transport_every_rank_can_use():
    own = [("a", None), ("a", None)]  # two devices, one each
    assert choose("auto", ranks_of(*own, cuda_aware=True, nccl=True)) == "cuda-aware"
    assert choose("auto", ranks_of(*own, nccl=True)) == "nccl"
    assert choose("auto", ranks_of(("a", 0), ("a", 0), nccl=True)) == "staging"  # one device shared
    assert choose("auto", ranks_of(*own)) == "staging"
    mixed = ranks_of(*own, cuda_aware=True)
    mixed[1] = Rank("a", 2, None, False, False)
    assert choose("auto", mixed) == "staging"


def test_a_transport_that_cannot_run_is_refused_saying_why():
    with pytest.raises(TransportUnavailableError, match="MPI library of rank 0 is not CUDA-aware"):
        choose("cuda-aware", ranks_of(("a", None), ("a", None)))
    with pytest.raises(TransportUnavailableError, match=r"no usable NCCL on rank 0 \(cupy.cuda.nccl"):
        choose("nccl", ranks_of(("a", None), ("a", None)))
    with pytest.raises(TransportUnavailableError, match="ranks 0 and 2 share device 0 of a"):
        choose("nccl", ranks_of(("a", None), ("a", None), ("a", None), nccl=True))
    assert choose("nccl", ranks_of(("a", None), ("b", None), nccl=True, devices_seen=1)) == "nccl"
    assert choose("staging", ranks_of(("a", 0), ("a", 0))) == "staging"  # always there
    with pytest.raises(TransportUnavailableError, match="transport must be one of auto, cuda-aware"):
        choose("tcp", ranks_of(("a", None)))


def test_cuda_awareness_is_asked_of_the_mpi_library_or_asserted(monkeypatch):
    monkeypatch.setenv(_transport.CUDA_AWARE_VARIABLE, "1")
    assert _transport._cuda_aware_mpi() is True
    monkeypatch.setenv(_transport.CUDA_AWARE_VARIABLE, "0")
    assert _transport._cuda_aware_mpi() is False
    monkeypatch.delenv(_transport.CUDA_AWARE_VARIABLE)
    assert _transport._cuda_aware_mpi() is False  # no MPI library loaded in this process


def test_the_library_refuses_a_bad_device_or_transport():
    model = load_model(DATA / "tiny.yaml")
    for kwargs, message in [({"device": "tpu"}, "device must be cpu or gpu"),
                            ({"transport": "tcp"}, "transport must be one of auto, cuda-aware, nccl")]:
        with pytest.raises(ValueError, match=message):
            distributed.backward(model, None, None, comm=object(), **kwargs)


@pytest.mark.gpu
def test_a_message_splits_into_its_host_part_and_its_device_arrays():
    xp = backend.get("gpu").xp
    model = load("mlp:0")
    shapes = model.shapes(model.input_shape)
    model.forward(xp.asarray(np.random.default_rng(0).standard_normal((2,) + model.input_shape)))
    product = SliceProduct(model.layers[:4], shapes[0]).compute(model.transposed_jacobians()[:4])
    vector = xp.ones((2, 3))
    message = ([vector], {"product": product, "rank": 3}, "text")
    skeleton, arrays = _transport.split(message)
    assert len(arrays) == 2 and arrays[0] is vector and arrays[1] is product.data
    data = product.data
    assert _transport.slots(skeleton) == [_transport.Slot(0, (2, 3), vector.dtype.str),
                                          _transport.Slot(1, tuple(data.shape), data.dtype.str)]
    assert skeleton[1]["product"].pattern is product.pattern and skeleton[2] == "text"
    joined = _transport.join(skeleton, arrays)
    assert joined[0][0] is vector and joined[1]["product"].data is product.data
    host = ({"stats": 1}, np.ones(3))
    assert _transport.split(host) == (host, [])  # nothing on the device: the message as it was


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["mlp:0", "rnn:0", "random:0"])
def test_a_slice_product_applies_on_the_device_as_on_the_host(model):
    xp = backend.get("gpu").xp
    network = load(model)
    x = np.random.default_rng(1).standard_normal((3,) + network.input_shape)
    shapes = network.shapes(network.input_shape)
    a, b = 1, len(network) - 1
    vectors = np.random.default_rng(2).standard_normal((3, int(np.prod(shapes[b]))))
    planned = SliceProduct(network.layers[a:b], shapes[a])
    network.forward(x)
    host = apply(planned.compute(network.transposed_jacobians()[a:b]), vectors)
    network.forward(xp.asarray(x))
    device = apply(planned.compute(network.transposed_jacobians()[a:b]), xp.asarray(vectors))
    assert type(device).__module__.startswith("cupy")
    np.testing.assert_allclose(device.get(), host, rtol=1e-12, atol=1e-14)


# --- under mpirun, every rank on a GPU --------------------------------------------------------------
@needs_mpi
@gpu_ranks
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("model", [TINY, LENET5, "rnn:0"])
@pytest.mark.parametrize("combine", ["chain", "exscan", "relay"])
def test_gpu_ranks_through_host_staging_equal_one_process(tmp_path, ranks, model, combine):
    out = tmp_path / "grads.npz"
    result = worker(ranks, model, out, "--combine", combine, "--transport", "staging")
    assert result.returncode == 0, result.stderr
    got = _compare(out, load(model))
    assert list(got["transport"]) == ["staging"] * ranks and list(got["devices"]) == ["gpu:0"] * ranks
    # every device byte a rank sent arrived: what the transport moved is what the stats claim
    assert got["transport_sent"].sum() == got["transport_received"].sum() > 0
    if combine == "exscan":  # a slice product's pattern (host index arrays) travels in the message
        assert (got["sent_bytes"] >= got["transport_sent"]).all()
    else:  # vectors and activations only: every payload byte moved by the transport
        np.testing.assert_array_equal(got["sent_bytes"], got["transport_sent"])
    if model.startswith("rnn") and combine != "relay":  # dense H×H slice products pay
        assert (got["products"][1:-1] > 0).all()


@needs_mpi
@gpu_ranks
@pytest.mark.parametrize("transport, env", [("staging", {}), ("cuda-aware", CUDA_AWARE), ("nccl", NCCL)])
def test_each_transport_moves_the_bytes_of_the_cpu_ranks_messages(tmp_path, transport, env):
    """The same run on CPU ranks (arrays pickled in the messages) and on GPU ranks: every rank sends the
    same payload, the device part of it through the transport."""
    if env and not STANDIN:
        pytest.skip("asserting a CUDA-aware MPI is for the stand-in, whose device memory is the host's")
    cpu = mpirun(3, sys.executable, str(WORKER), LENET5, str(tmp_path / "cpu.npz"), "--combine", "exscan")
    assert cpu.returncode == 0, cpu.stderr
    gpu = worker(3, LENET5, tmp_path / "gpu.npz", "--combine", "exscan", "--transport", transport, env=env)
    assert gpu.returncode == 0, gpu.stderr
    with np.load(tmp_path / "cpu.npz") as one, np.load(tmp_path / "gpu.npz") as other:
        np.testing.assert_array_equal(other["sent_bytes"], one["sent_bytes"])
        assert list(other["transport"]) == [transport] * 3 and list(one["transport"]) == ["mpi"] * 3
        devices_used = ["gpu:0", "gpu:1", "gpu:2"] if transport == "nccl" else ["gpu:0"] * 3
        assert list(other["devices"]) == devices_used  # local rank modulo the devices
        assert other["transport_sent"].sum() == other["transport_received"].sum()
        middle = one["products"][1]  # the middle rank's slice product: its values on the device
        assert middle > 0 and other["sent_bytes"][1] - other["transport_sent"][1] > 0
        for key in one:
            if key.startswith(("grad.", "param.")):
                np.testing.assert_allclose(other[key], one[key], rtol=1e-10, atol=1e-12, err_msg=key)


@needs_mpi
@gpu_ranks
def test_auto_detects_the_transport_and_reports_it(tmp_path):
    if not STANDIN:
        pytest.skip("asserting a CUDA-aware MPI is for the stand-in, whose device memory is the host's")
    plain = worker(2, TINY, tmp_path / "a.npz")
    assert plain.returncode == 0, plain.stderr
    aware = worker(2, TINY, tmp_path / "b.npz", env={**CUDA_AWARE, **NCCL})
    assert aware.returncode == 0, aware.stderr
    nccl = worker(2, TINY, tmp_path / "c.npz", env=NCCL)
    assert nccl.returncode == 0, nccl.stderr
    shared = worker(2, TINY, tmp_path / "d.npz", env={"SPARSE_SCAN_STANDIN_NCCL": "1"})  # one device
    assert shared.returncode == 0, shared.stderr
    found = []
    for name in "abcd":
        with np.load(tmp_path / f"{name}.npz") as got:
            found.append(list(got["transport"]))
    # MPICH without CUDA, no NCCL: staging; then the first of cuda-aware, nccl, staging that can run
    assert found == [["staging"] * 2, ["cuda-aware"] * 2, ["nccl"] * 2, ["staging"] * 2]


@needs_mpi
@gpu_ranks
def test_the_cli_on_gpu_ranks_writes_what_one_process_writes(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((3, 1, 28, 28)))
    np.save(tmp_path / "y.npy", rng.integers(0, 10, 3))
    common = ["--input", str(tmp_path / "x.npy"), "--labels", str(tmp_path / "y.npy"), "--dtype", "float64"]
    one = subprocess.run([sys.executable, "-m", "sparse_scan.cli", "run", LENET5, *common, "--device", "cpu",
                          "--out", str(tmp_path / "one.npz")], capture_output=True, text=True,
                         timeout=LIMIT_S, cwd=ROOT)
    assert one.returncode == 0, one.stderr
    result = cli(3, LENET5, *common, "--distributed", "--device", "gpu", "--transport", "staging", "--check",
                 "--json", "--out", str(tmp_path / "many.npz"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["device"] == "gpu" and report["distributed"]["transport"] == "staging"
    assert [r["device"] for r in report["distributed"]["per_rank"]] == ["gpu:0"] * 3
    assert report["check"]["max_rel_error"] < 1e-10
    with np.load(tmp_path / "one.npz") as single, np.load(tmp_path / "many.npz") as many:
        assert list(single) == list(many)
        for key in single:
            np.testing.assert_allclose(many[key], single[key], rtol=1e-10, atol=1e-12, err_msg=key)


@needs_mpi
@gpu_ranks
@pytest.mark.parametrize("transport, env, reason", [
    ("nccl", {}, "CuPy has no usable NCCL on rank 0 (cupy.cuda.nccl.available is False)"),
    ("nccl", {"SPARSE_SCAN_STANDIN_NCCL": "1"}, "NCCL needs a device per rank; ranks 0 and 1 share device 0"),
    ("cuda-aware", {}, "the MPI library of rank 0 is not CUDA-aware")])
def test_the_cli_refuses_a_transport_that_is_not_there_in_one_line(transport, env, reason):
    if not STANDIN:
        pytest.skip("which transports a GPU machine lacks depends on it")
    result = cli(2, TINY, "--random", "2", "--distributed", "--device", "gpu", "--transport", transport,
                 env={"SPARSE_SCAN_CUDA_AWARE_MPI": "0", **env})
    assert result.returncode == 2 and result.stdout == ""
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith(f"sparse-scan: error: --transport {transport}: transport "
                                                f"'{transport}' is not available: {reason}")


@needs_mpi
@gpu_ranks
def test_gpu_device_puts_a_rank_on_the_device_asked_for():
    if not STANDIN:
        pytest.skip("the stand-in is given two devices")
    result = cli(2, TINY, "--random", "2", "--distributed", "--device", "gpu", "--gpu-device", "1", "--json",
                 env={"SPARSE_SCAN_STANDIN_DEVICES": "2"})
    assert result.returncode == 0, result.stderr
    assert [r["device"] for r in json.loads(result.stdout)["distributed"]["per_rank"]] == ["gpu:1"] * 2
    result = cli(2, TINY, "--random", "2", "--distributed", "--device", "gpu", "--gpu-device", "2")
    assert result.returncode == 2
    assert "rank 0 asked for device 2 but sees 1 device(s)" in result.stderr


@needs_mpi
def test_the_cli_refuses_gpu_ranks_without_a_gpu_and_transport_options_on_cpu_ranks():
    """Without a usable GPU (the real CuPy, no stand-in) --device gpu is an error, never CPU ranks."""
    if backend.gpu_usable():
        pytest.skip("a GPU is usable here")
    result = mpirun(2, sys.executable, "-m", "sparse_scan.cli", "run", TINY, "--random", "2", "--distributed",
                    "--device", "gpu")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().startswith("sparse-scan: error: --device gpu: device='gpu' was requested "
                                            "but no GPU is usable")
    result = mpirun(2, sys.executable, "-m", "sparse_scan.cli", "run", TINY, "--random", "2", "--distributed",
                    "--device", "cpu", "--transport", "staging")
    assert result.returncode == 2
    assert result.stderr.strip() == ("sparse-scan: error: --transport and --gpu-device apply to GPU ranks "
                                     "only (--device gpu)")


@needs_mpi
@gpu_ranks
@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_failed_gpu_rank_is_named(tmp_path, failing):
    result = worker(3, LENET5, tmp_path / "g.npz", "--fail-rank", str(failing), "--transport", "staging")
    assert result.returncode != 0
    assert f"rank {failing} failed: RuntimeError: layer" in result.stderr
    assert "broke on purpose" in result.stderr


@needs_mpi
@gpu_ranks
def test_a_stuck_gpu_rank_times_out_instead_of_hanging(tmp_path):
    """As on CPU ranks (tests/test_distributed.py), with a 10 s timeout: rank 2 names rank 1 after
    10 s, while rank 0, two hops away, would wait 20 s."""
    result = worker(3, LENET5, tmp_path / "g.npz", "--hang-rank", "1", "--timeout", "10", "--transport",
                    "staging")
    assert result.returncode != 0
    assert "rank 2: receiving activations from rank 1 did not complete within 10 s" in result.stderr


@needs_mpi
@gpu_ranks
def test_the_benchmark_measures_gpu_ranks_and_their_links(tmp_path):
    """bench/distributed.py --device gpu, as tools/gpu_run.sh runs it, at a small size: a row per
    transport (one that cannot run says why), equal to one process, its link measured; the model then
    takes the measured link in place of the placeholder."""
    rows = tmp_path / "rows.jsonl"
    command = [sys.executable, str(ROOT / "bench" / "distributed.py"), "--device", "gpu", "--ranks", "2",
               "--transports", "staging,nccl", "--model", "tiny.yaml", "--batch", "2", "--repeats", "1",
               "--rank-command", " ".join(PYTHON), "--rows", str(rows)]
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT_S, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    staging, nccl = report["measured_gpu"]
    assert staging["transport"] == "staging" and staging["max_rel_error_vs_one_process"] < 1e-10
    assert staging["compared"] == 8 + 6 and staging["wall_s"] > 0 and staging["single_process_gpu_s"] > 0
    assert staging["sent_bytes"] == staging["transport_sent_bytes"]
    assert staging["link"]["latency_s"] > 0 and staging["link"]["bandwidth_bytes_per_s"] > 0
    if STANDIN:
        assert nccl["unavailable"].startswith("transport 'nccl' is not available")
    assert report["gpu_links"]["staging"]["measured"] is False  # placeholders until --links
    saved = read_rows(rows)
    assert saved["finished"] and saved["rows"] == report["measured_gpu"]
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "distributed.py"), "--no-measure",
                            "--links", str(rows)], capture_output=True, text=True, timeout=LIMIT_S, env=env,
                           cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    linked = json.loads(again.stdout)["gpu_links"]
    assert linked["staging"]["measured"] is True and linked["nccl"]["measured"] is False
    assert linked["staging"]["latency_s"] == staging["link"]["latency_s"]
    rnn = json.loads(again.stdout)["model"]["rnn-T30000-H20"][-1]
    assert set(rnn["gpu_comm_s"]) == {"staging", "cuda-aware", "nccl"}
