"""Long work talks: a status line on a terminal, a plain line at most every interval elsewhere, nothing
with ``--quiet``; errors on lines of their own; Ctrl-C is one line and exit code 130 at any point."""

from __future__ import annotations

import io
import pathlib
import re
import time

import numpy as np
import pytest
from click.testing import CliRunner

import sparse_scan
from sparse_scan.cli import _common, _progress, app

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "tiny.yaml"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def invoke(*args):
    return CliRunner().invoke(app.main, list(map(str, args)))


def seconds(text):
    """``text`` with every ``(12 s)`` as ``(N s)``: how long a status has run depends on the machine."""
    return re.sub(r"\(\d+ s\)", "(N s)", text)


def plain_lines(result):
    return [line for line in result.stderr.splitlines() if not line.startswith("sparse-scan: error")]


def test_a_terminal_gets_one_line_rewritten_and_wiped_at_the_end():
    stream = Terminal()
    with _progress.Progress(quiet=False, stream=stream) as progress:
        progress.show("planning: steps 1/3 done")
        progress.show("planning: steps 2/3 done")  # drawn at most every TTY_REFRESH_S: by the thread
        deadline = time.monotonic() + 60
        while "2/3" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    text = seconds(stream.getvalue())
    assert text.startswith("\r\x1b[Kplanning: steps 1/3 done (N s)")
    assert "\r\x1b[Kplanning: steps 2/3 done (N s)" in text and "\n" not in text
    assert text.endswith("\r\x1b[K")  # wiped: the command's output starts on a clean line


def test_output_and_errors_never_land_on_a_status_line(capsys):
    stream = Terminal()
    with _progress.Progress(quiet=False, stream=stream) as progress:
        progress.show("epoch 1/2: 3/23 batches done")
        progress.echo("epoch  1/2  train loss ...", stream)
        assert seconds(stream.getvalue()).endswith("(N s)\r\x1b[Kepoch  1/2  train loss ...\n")
        progress.show("epoch 2/2: 1/23 batches done")
        time.sleep(_progress.TTY_REFRESH_S * 1.5)
        progress.show("epoch 2/2: 2/23 batches done")
        _common.echo_error("out of memory", stream)
    assert seconds(stream.getvalue()).endswith("(N s)\r\x1b[Ksparse-scan: error: out of memory\n")


def test_elsewhere_a_plain_line_at_most_every_interval():
    stream = io.StringIO()
    with _progress.Progress(quiet=False, stream=stream, interval=3600) as progress:
        for step in range(100):
            progress.show(f"planning: steps {step}/100 done")
    assert stream.getvalue() == ""  # work shorter than the interval prints nothing
    with _progress.Progress(quiet=False, stream=stream, interval=0) as progress:
        progress.show("planning: steps 1/2 done")
        progress.show("planning: steps 2/2 done")
    assert seconds(stream.getvalue()).splitlines() == ["sparse-scan: planning: steps 1/2 done (N s)",
                                                       "sparse-scan: planning: steps 2/2 done (N s)"]


def test_a_step_that_takes_long_still_gets_its_lines():
    """The plain lines come from a thread too: one step of minutes (a product planned) is not silent."""
    stream = io.StringIO()
    with _progress.Progress(quiet=False, stream=stream, interval=0.05) as progress:
        progress.show("planning: steps 13/42 done, product rows 5 %")
        deadline = time.monotonic() + 60
        while stream.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the main thread busy elsewhere, not calling show
    assert stream.getvalue().count("product rows 5 %") >= 2


def test_quiet_shows_nothing():
    for stream in (io.StringIO(), Terminal()):
        with _progress.Progress(quiet=True, stream=stream, interval=0) as progress:
            progress.show("planning")
            time.sleep(_progress.TTY_REFRESH_S * 1.5)
        assert stream.getvalue() == ""


def test_plan_status_names_the_phase_and_the_product_rows():
    stream = io.StringIO()
    with _progress.Progress(quiet=False, stream=stream, interval=0) as progress:
        show = _progress.plan_status(progress)
        show("sizes", 3, 24)
        show("steps", 13, 42)
        show("product rows", 1024, 4096)
    assert seconds(stream.getvalue()).splitlines() == [
        "sparse-scan: planning: JT sizes 3/24 (N s)", "sparse-scan: planning: steps 13/42 (N s)",
        "sparse-scan: planning: steps 13/42 done, product rows 25 % (N s)"]


@pytest.mark.parametrize("args, statuses", [
    (["run", DATA / "lenet5.yaml", "--random", "2", "--check"],
     ["loading", "planning: JT sizes 12/12", "planning: steps 12/12", "forward", "backward (linear)",
      "parameter gradients", "check: each layer's JT applied by SciPy"]),
    (["flops", DATA / "lenet5.yaml", "--random", "3"],
     ["planning: steps", "live FLOPs: samples 1/3", "live FLOPs: samples 3/3"]),
    (["train", TINY, "--data", "bitstream", "--epochs", "2"], None),
    (["eval", DATA / "lenet5-digits.yaml", "--data", "digits"],
     ["loading --data digits", "evaluating the train split (1437 samples)",
      "evaluating the test split (360 samples)"]),
])
def test_every_command_shows_its_work_when_piped_and_quiet_silences_it(monkeypatch, args, statuses):
    """With the interval at 0 every status is a line: what a long run prints every 10 s."""
    if args[0] == "train":  # the bundled digits LeNet-5: two short epochs
        pytest.importorskip("sklearn")
        args = ["train", DATA / "lenet5-digits.yaml", "--data", "digits", "--epochs", "2"]
        statuses = ["planning", "epoch 1/2: 0/23 batches done", "epoch 1/2: 22/23 batches done",
                    "epoch 2/2: 0/23 batches done"]
    if args[0] == "eval":
        pytest.importorskip("sklearn")
    monkeypatch.setattr(_progress, "PLAIN_INTERVAL_S", 0.0)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    lines = plain_lines(result)
    assert all(line.startswith("sparse-scan: ") and line.endswith(" s)") for line in lines), lines
    for status in statuses:
        assert any(status in line for line in lines), (status, lines)
    quiet = invoke(*args, "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sparse_scan, "load_model", interrupted)
    for args in (["run", TINY, "--random", "2"], ["flops", TINY], ["eval", TINY, "--data", "digits"]):
        result = invoke(*args)
        assert result.exit_code == 130, result.output
        assert result.output.splitlines() == ["", "sparse-scan: interrupted"]  # the blank line ends ^C


def test_ctrl_c_while_training_keeps_the_weights_log_and_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from sparse_scan.optim import Adam

    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    np.savez(data, x_train=rng.random((20, 1, 8, 8)), y_train=rng.integers(0, 10, 20),
             x_test=rng.random((5, 1, 8, 8)), y_test=rng.integers(0, 10, 5))
    step, steps = Adam.step, []

    def interrupted_at_the_third(self, grads):
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        step(self, grads)

    monkeypatch.setattr(Adam, "step", interrupted_at_the_third)
    result = invoke("train", TINY, "--data", data, "--batch-size", "4", "--out", tmp_path / "w.npz", "--log",
                    tmp_path / "loss.csv", "--plot", tmp_path / "loss.png")
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-1] == (
        f"sparse-scan: interrupted; weights so far in {tmp_path / 'w.npz'}, log in {tmp_path / 'loss.csv'}, "
        f"plot of 2 iterations in {tmp_path / 'loss.png'}")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "loss.csv").read_text().splitlines()) == 3  # the header and 2 iterations
    with np.load(tmp_path / "w.npz") as weights:
        assert "fc.weight" in weights
