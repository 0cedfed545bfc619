# sparse-scan developer commands. Every target runs with $(PYTHON); use a virtual environment, or pass
# one explicitly: `make test PYTHON=/path/to/venv/bin/python`.
PYTHON = python3
PYTEST_ARGS =
BENCH_ARGS =
# The lint rules live here (pyproject.toml holds the build system only): pyflakes, pycodestyle,
# import order and bugbear, lines up to 110 characters.
LINT_PATHS = sparse_scan cli rawkernels tests bench tools
RUFF_ARGS = --select E,W,F,I,B --line-length 110 --config "lint.isort.known-first-party = ['sparse_scan']"

.PHONY: help install test test-gpu test-gpu-standin test-mpi bench bench-distributed demo lint check-kernels wheel-check

help:
	@echo "make install      pip install -e '.[test]' into $(PYTHON)"
	@echo "make demo         install the package alone, then run the main job on bundled data (Table 1, a scan on LeNet-5, FLOPs of pruned VGG-11)"
	@echo "make test         install, then run the test suite (gpu tests skip where no GPU is usable)"
	@echo "make test-gpu     install offline (no deps, no build isolation), run only the tests marked gpu"
	@echo "make test-gpu-standin  install, run every gpu test on the CPU through the CuPy stand-in (none may"
	@echo "                  skip), then report the GPU glue's line coverage (at least $(GPU_COVERAGE_MIN) %)"
	@echo "make test-mpi     install, then run the scan-across-processes tests (mpirun -n 2 and -n 3; GPU ranks"
	@echo "                  on the CuPy stand-in where no GPU is usable)"
	@echo "make bench        install, then run the Jacobian benchmark and print JSON (BENCH_ARGS=...)"
	@echo "make bench-distributed  install, then measure P = 1, 2, 3 ranks and model P up to 1024 (JSON)"
	@echo "make lint         ruff check (skipped with a note where ruff is not installed)"
	@echo "make check-kernels  compile every kernel instantiation as CuPy does (NVRTC), sm_80 and sm_90, no GPU"
	@echo "make wheel-check  build sdist + wheel, install the wheel in a fresh venv outside the repo, check it"

install:
	$(PYTHON) -m pip install -e '.[test]'

test: install
	$(PYTHON) -m pytest $(PYTEST_ARGS)

# GPU machines may have no network and bring their own CuPy (any cupy >= 13): install without
# dependencies or build isolation, so nothing is downloaded and the installed CuPy is kept.
test-gpu:
	$(PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PYTHON) -m pytest -m gpu $(PYTEST_ARGS)

# Every gpu test on the CPU through the CuPy stand-in (tests/cupy_standin; docs/gpu.md), none skipped,
# under coverage; then the line coverage of the GPU glue (tools/gpu_coverage.py) must reach the minimum.
GPU_COVERAGE_MIN = 95
test-gpu-standin: install
	SPARSE_SCAN_CUPY_STANDIN=1 SPARSE_SCAN_NO_GPU_SKIPS=1 $(PYTHON) -m coverage run \
		--data-file=.coverage.gpu --source=sparse_scan -m pytest -m gpu -q -rs $(PYTEST_ARGS)
	$(PYTHON) tools/gpu_coverage.py --data-file .coverage.gpu --fail-under $(GPU_COVERAGE_MIN)

# the MPI tests fail instead of skipping when mpi4py or mpiexec is missing
test-mpi: install
	SPARSE_SCAN_REQUIRE_MPI=1 $(PYTHON) -m pytest tests/test_distributed.py tests/test_distributed_gpu.py $(PYTEST_ARGS)

bench-distributed: install
	$(PYTHON) bench/distributed.py $(BENCH_ARGS)

bench: install
	$(PYTHON) bench/jacobians.py --json $(BENCH_ARGS)

# the demo needs the package alone (no test extra, no compiler): numpy, scipy, click, pyyaml
demo:
	$(PYTHON) -m pip install -e .
	$(PYTHON) bench/jacobians.py --quick
	$(PYTHON) -m sparse_scan.cli run data/lenet5.yaml --random 16 --method blelloch --check
	$(PYTHON) -m sparse_scan.cli flops data/vgg11-pruned.yaml --method hybrid --levels 1

lint:
	@if $(PYTHON) -m ruff --version >/dev/null 2>&1; then \
		$(PYTHON) -m ruff check $(RUFF_ARGS) $(LINT_PATHS); \
	else \
		echo "make lint: ruff is not installed for $(PYTHON); '$(PYTHON) -m pip install ruff' to lint"; \
	fi

# Every RawKernel instantiation of sparse_scan/_gpu_kernels.py's registry, compiled as cupy.RawModule compiles
# it (NVRTC, name expressions), for sm_80 and sm_90; needs the nvrtc extra (part of the test extra), no GPU.
check-kernels:
	$(PYTHON) tools/check_kernels.py

wheel-check:
	$(PYTHON) tools/check_wheel.py
