"""Backend selection (cpu | gpu | auto), the GPU-unavailable error, lazy CuPy, twin dispatch."""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest
import scipy.sparse

from sparse_scan import backend

CACHED = (backend._cupy, backend.gpu_usable, backend._cpu_backend, backend._gpu_backend)


def _clear_caches():
    for function in CACHED:
        function.cache_clear()


@pytest.fixture
def fresh_caches():
    """Clear the lru_caches before and after, so simulated environments neither see nor leak state."""
    _clear_caches()
    yield
    _clear_caches()


def _fake_cupy(is_available):
    cuda = types.SimpleNamespace(is_available=is_available)
    return types.SimpleNamespace(__name__="cupy", cuda=cuda)


@pytest.fixture
def no_cupy(monkeypatch, fresh_caches):
    monkeypatch.setattr(backend, "_cupy", lambda: None)


@pytest.fixture
def cupy_without_device(monkeypatch, fresh_caches):
    monkeypatch.setattr(backend, "_cupy", lambda: _fake_cupy(lambda: False))


@pytest.fixture
def fake_gpu(monkeypatch, fresh_caches):
    """A CuPy that reports a device; the GPU backend is a stand-in (no cupyx import)."""
    fake = _fake_cupy(lambda: True)
    monkeypatch.setattr(backend, "_cupy", lambda: fake)
    stand_in = backend.Backend("gpu", fake, types.SimpleNamespace(__name__="cupyx.scipy.sparse"))
    monkeypatch.setattr(backend, "_gpu_backend", lambda: stand_in)
    return stand_in


# --- cpu ---------------------------------------------------------------------------------------
def test_cpu_is_numpy_and_scipy():
    cpu = backend.get("cpu")
    assert cpu.name == "cpu"
    assert cpu.xp is np
    assert cpu.sparse is scipy.sparse
    assert backend.get("cpu") is cpu  # built once


def test_cpu_needs_no_gpu_probe(monkeypatch, fresh_caches):
    def fail():
        raise AssertionError("device='cpu' must not look for CuPy")

    monkeypatch.setattr(backend, "_cupy", fail)
    monkeypatch.setattr(backend, "gpu_usable", fail)
    assert backend.get("cpu").name == "cpu"


def test_cpu_asarray_and_to_host():
    cpu = backend.get("cpu")
    a = cpu.asarray([1, 2, 3], dtype=np.float32)
    assert isinstance(a, np.ndarray) and a.dtype == np.float32
    assert cpu.to_host(a) is a
    assert backend.of(a) is cpu
    assert backend.of([1.0]) is cpu


# --- auto --------------------------------------------------------------------------------------
def test_auto_matches_this_machine():
    expected = "gpu" if backend.gpu_usable() else "cpu"
    assert backend.get("auto").name == expected
    assert backend.get().name == expected  # "auto" is the default


@pytest.mark.skipif(backend.gpu_usable(), reason="a GPU is usable here")
def test_auto_is_cpu_without_gpu():
    assert backend.get("auto") is backend.get("cpu")


def test_auto_falls_back_without_cupy(no_cupy):
    assert backend.gpu_usable() is False
    assert backend.get("auto").name == "cpu"


def test_auto_falls_back_without_device(cupy_without_device):
    assert backend.gpu_usable() is False
    assert backend.get("auto").name == "cpu"


def test_auto_picks_a_usable_gpu(fake_gpu):
    assert backend.gpu_usable() is True
    assert backend.get("auto") is fake_gpu
    assert backend.get("gpu") is fake_gpu


# --- gpu unavailable ---------------------------------------------------------------------------
def test_gpu_without_cupy_is_a_clear_error(no_cupy):
    with pytest.raises(backend.GPUUnavailableError) as info:
        backend.get("gpu")
    message = str(info.value)
    assert "device='gpu'" in message
    assert "CuPy is not installed" in message
    assert "'gpu' extra" in message and "device='cpu'" in message


def test_gpu_without_device_is_a_clear_error(cupy_without_device):
    with pytest.raises(backend.GPUUnavailableError, match=r"cupy\.cuda\.is_available\(\) is False"):
        backend.get("gpu")


def test_is_available_raising_means_unusable(monkeypatch, fresh_caches):
    def broken():
        raise RuntimeError("CUDA driver library not found")

    monkeypatch.setattr(backend, "_cupy", lambda: _fake_cupy(broken))
    assert backend.gpu_usable() is False
    with pytest.raises(backend.GPUUnavailableError):
        backend.get("gpu")


def test_gpu_unavailable_is_a_runtime_error():
    assert issubclass(backend.GPUUnavailableError, RuntimeError)


@pytest.mark.skipif(backend.gpu_usable(), reason="a GPU is usable here")
def test_gpu_unavailable_on_this_machine():
    with pytest.raises(backend.GPUUnavailableError, match="no GPU is usable"):
        backend.get("gpu")


def test_real_cupy_probe_is_cached(fresh_caches):
    first = backend.gpu_usable()
    assert backend.gpu_usable() is first
    assert backend.gpu_usable.cache_info().hits >= 1


# --- invalid -----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["GPU", "cuda", "cuda:0", "", None, 0])
def test_invalid_device_is_a_value_error(device):
    with pytest.raises(ValueError, match="device must be one of cpu, gpu, auto"):
        backend.get(device)


# --- lazy import -------------------------------------------------------------------------------
def test_importing_the_package_does_not_import_cupy():
    code = (
        "import sys, sparse_scan, sparse_scan.layers, sparse_scan.cli.app\n"
        "sparse_scan.backend.get('cpu')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupyx'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- twin dispatch -----------------------------------------------------------------------------
def test_twin_dispatches_on_backend_name(fake_gpu):
    calls = []

    def cpu_twin(be, a, scale=1):
        """Scale ``a``."""
        calls.append(("cpu", be.name))
        return a * scale

    def gpu_twin(be, a, scale=1):
        calls.append(("gpu", be.name))
        return -a * scale

    op = backend.twin(cpu=cpu_twin, gpu=gpu_twin)
    assert op(backend.get("cpu"), 3, scale=2) == 6
    assert op(fake_gpu, 3, scale=2) == -6
    assert calls == [("cpu", "cpu"), ("gpu", "gpu")]
    assert op.twins == {"cpu": cpu_twin, "gpu": gpu_twin}
    assert op.__name__ == "cpu_twin" and op.__doc__ == "Scale ``a``."


def test_twin_rejects_unknown_backend():
    op = backend.twin(cpu=lambda be: "cpu", gpu=lambda be: "gpu")
    with pytest.raises(KeyError):
        op(backend.Backend("tpu", np, scipy.sparse))


# --- real GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_backend_is_cupy():
    gpu = backend.get("gpu")
    assert gpu.name == "gpu" and gpu.xp.__name__ == "cupy"
    assert gpu.sparse.__name__ == "cupyx.scipy.sparse"
    a = gpu.asarray(np.arange(4, dtype=np.float32))
    assert backend.of(a) is gpu
    np.testing.assert_array_equal(gpu.to_host(a), np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(backend.get("cpu").asarray(a), np.arange(4, dtype=np.float32))
    assert backend.get("auto") is gpu


def test_to_host_passes_host_arrays_on_every_backend_and_caches_are_per_device():
    gpu_named = backend.Backend("gpu", np, scipy.sparse)  # NumPy standing in for CuPy
    labels = np.array([1, 2])
    assert gpu_named.to_host(labels) is labels  # host labels beside device logits: no .get()
    assert backend.get("cpu").device_key() == "cpu"
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=3)))
    assert backend.Backend("gpu", fake, scipy.sparse).device_key() == ("gpu", 3)
