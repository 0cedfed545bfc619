"""Writing outputs (issue 47): an interrupted or killed write leaves no partial file and no debris
that outlives the next write, and a symlink is written through, never replaced."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from sparse_scan.cli import app
from sparse_scan.weights import read_npz, write_npz_atomically

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
TINY = DATA / "tiny.yaml"
ARRAYS = {"a": np.arange(6.0).reshape(2, 3), "b": np.ones(4, np.float32)}


def same(path, arrays=ARRAYS):
    stored = read_npz(path)
    return stored.keys() == arrays.keys() and all(np.array_equal(stored[k], v) for k, v in arrays.items())


def debris(folder):
    return sorted(entry.name for entry in pathlib.Path(folder).iterdir() if entry.name.startswith("."))


def killed_while_writing(target):
    """A process that is killed (SIGKILL) in the middle of writing ``target``: its pid."""
    script = ("import os, signal, numpy as np\n"
              "from sparse_scan.weights import write_npz_atomically\n"
              "def savez(stream, **arrays):\n"
              "    stream.write(b'PK partial')\n"
              "    stream.flush()\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n"
              "np.savez = savez\n"
              f"write_npz_atomically({str(target)!r}, {{'a': np.zeros(3)}})\n")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    return child


def test_a_write_killed_midway_leaves_debris_that_the_next_write_removes(tmp_path):
    target = tmp_path / "w.npz"
    write_npz_atomically(target, ARRAYS)
    killed_while_writing(target)
    left = debris(tmp_path)
    assert len(left) == 1 and left[0].startswith(".w.npz.") and left[0].endswith(".npz")  # the partial file
    assert same(target)  # the old file intact
    alive = tmp_path / f".w.npz.{os.getpid()}.inprogress.npz"  # a write of a process that runs: kept
    alive.write_bytes(b"PK")
    write_npz_atomically(target, {"a": np.zeros(2)})
    assert debris(tmp_path) == [alive.name] and same(target, {"a": np.zeros(2)})


def test_the_command_line_removes_a_killed_writes_debris_before_it_starts(tmp_path):
    target = tmp_path / "g.npz"
    killed_while_writing(target)
    assert len(debris(tmp_path)) == 1 and not target.exists()
    result = CliRunner().invoke(app.main, ["run", str(TINY), "--random", "2", "--out", str(target)])
    assert result.exit_code == 0, result.output
    assert debris(tmp_path) == [] and set(read_npz(target)) >= {"input.grad", "fc.weight.grad"}


def test_ctrl_c_during_a_write_takes_effect_once_the_file_is_complete(tmp_path, monkeypatch):
    """SIGINT in the middle of np.savez: the file is written whole, then KeyboardInterrupt; no
    temporary is left and no ZipFile is left half closed ('Exception ignored in: ZipFile.__del__')."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    real = np.savez

    def interrupted(stream, **arrays):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, delivered while the archive is being written
        real(stream, **arrays)

    monkeypatch.setattr(np, "savez", interrupted)
    target = tmp_path / "w.npz"
    with pytest.raises(KeyboardInterrupt):
        write_npz_atomically(target, ARRAYS)
    assert same(target) and debris(tmp_path) == [] and unraisable == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def run_out(path, *options):
    return CliRunner().invoke(app.main, ["run", str(TINY), "--random", "2", "--quiet", "--out", str(path),
                                         *options])


def test_an_output_named_by_a_symlink_is_written_through_it(tmp_path):
    """The link is the user's: it stays a link, and the file it leads to is replaced (atomically,
    beside that file); without --force it is an existing file, dangling or not."""
    real = tmp_path / "store" / "grads.npz"
    real.parent.mkdir()
    write_npz_atomically(real, ARRAYS)
    link = tmp_path / "link.npz"
    link.symlink_to(pathlib.Path("store") / "grads.npz")  # relative, as ln -s makes them
    refused = run_out(link)
    assert refused.exit_code == 2
    assert "exists (use --force to overwrite through the symlink)" in refused.output
    result = run_out(link, "--force")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(pathlib.Path("store") / "grads.npz")
    assert "input.grad" in read_npz(real) and debris(real.parent) == [] and debris(tmp_path) == []
    dangling = tmp_path / "new.npz"
    dangling.symlink_to(tmp_path / "store" / "new.npz")
    created = tmp_path / "store" / "new.npz"
    refused = run_out(dangling)
    assert refused.exit_code == 2 and "exists" in refused.output and not created.exists()
    result = run_out(dangling, "--force")
    assert result.exit_code == 0 and dangling.is_symlink() and "input.grad" in read_npz(created)
