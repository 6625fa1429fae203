"""`a2 train` as a user runs it: one line per epoch, a short summary at the end (with the test scores), the history
and the test scores in files, and a second run that never overwrites the first one's checkpoints."""
import json
import subprocess
import sys

import pytest
import yaml

from a2core.data import synthetic

pytestmark = pytest.mark.slow


def synthetic_test_ids(root) -> list[int]:
    images = json.loads((root / "dataset_coco.json").read_text())["images"]
    return [im["cocoid"] for im in images if im["split"] == "test"]


def a2_train(*args, cwd):
    return subprocess.run([sys.executable, "-m", "launch.cli", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_train_summarises_and_never_overwrites_an_earlier_run(tmp_path):
    root = tmp_path / "data"
    synthetic.generate(root, seed=3, images=40, test_images=5)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"root": str(root), "images": 40, "seed": 3, "val_images": 5},
        "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10, "fusion": "gate"},
        "train": {"xe_epochs": 2, "batch_size": 50, "warmup": 10}}))
    first = a2_train("--config", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["epoch 1", "epoch 2"]
    assert "val/CIDEr" in lines[0] and "{" not in first.stdout  # no JSON dump of the history
    assert lines[-5].startswith("best val/CIDEr ") and lines[-2] == "checkpoint: runs/a2/best.pt"
    history = json.loads((tmp_path / "runs/a2/history.json").read_text())
    assert [h["epoch"] for h in history] == [1, 2]

    # The end-of-run test evaluation (best epoch, beam search) is printed on the x100 scale and kept in a file
    best_epoch = int(lines[-5].split(" at epoch ")[1].split()[0])
    test = json.loads((tmp_path / "runs/a2/test_scores.json").read_text())
    assert test["epoch"] == best_epoch and test["beam_size"] == 5 and test["split"] == "test"
    assert lines[-4].startswith(f"test (epoch {best_epoch}, beam 5, {test['images']} images, x100): BLEU-1 ")
    assert lines[-3] == "test scores: runs/a2/test_scores.json"
    shown = dict(zip(lines[-4].split(": ", 1)[1].split()[::2], map(float, lines[-4].split(": ", 1)[1].split()[1::2])))
    assert shown == {k: round(v, 2) for k, v in test["scores"].items()}
    assert {"BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr"} <= set(test["scores"])
    assert all(0 <= v <= 1000 for v in test["scores"].values()) and test["scores"]["BLEU-1"] > 1  # x100, not x1
    assert len(test["per_image_cider"]) == test["images"] == len(synthetic_test_ids(root))
    assert sum(test["per_image_cider"].values()) / test["images"] == pytest.approx(test["scores"]["CIDEr"])
    # ... the same numbers as the tutorial's `a2 decode` + `a2 evaluate` of the best checkpoint
    decoded = subprocess.run([sys.executable, "-m", "launch.cli", "decode", "--checkpoints", "runs/a2/best.pt",
                              "--out", "res.json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert decoded.returncode == 0, decoded.stderr
    scored = subprocess.run([sys.executable, "-m", "launch.cli", "evaluate", "--results", "res.json", "--captions",
                             str(root / "dataset_coco.json")], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stderr
    again = json.loads(scored.stdout)
    for name in ("BLEU-4", "ROUGE-L", "CIDEr"):
        assert again[name] == pytest.approx(test["scores"][name], abs=1e-6), name
    best_before = (tmp_path / "runs/a2/best.pt").read_bytes()

    second = a2_train("--config", str(config), "train.xe_epochs=1", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "runs/a2 holds an earlier run's checkpoints; this run writes to runs/a2-2" in second.stdout
    assert (tmp_path / "runs/a2/best.pt").read_bytes() == best_before
    assert [h["epoch"] for h in json.loads((tmp_path / "runs/a2-2/history.json").read_text())] == [1]


def _tiny_config(tmp_path, **train) -> str:
    """A run of a few seconds an epoch on 2 cores: 40 synthetic images, 4 steps an epoch (10 pairs a step)."""
    root = tmp_path / "data"
    if not root.exists():
        synthetic.generate(root, seed=3, images=40, test_images=5)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"root": str(root), "images": 40, "seed": 3, "val_images": 5},
        "model": {"d_model": 16, "layers": 1, "heads": 2, "d_ff": 32, "max_regions": 10},
        "train": {"xe_epochs": 1, "batch_size": 50, "warmup": 10, "test_meteor": False, "diag_images": 5,
                  "diag_kendall_images": 2, **train}}))
    return str(config)


def test_train_draws_a_bar_within_each_epoch_on_a_terminal(tmp_path):
    """On a terminal (stderr a pty with a size), each epoch gets a bar of its optimizer steps with the rate, the time
    left and the running loss; the step lines are what the bar shows, so they stay off it."""
    import fcntl
    import os
    import pty
    import struct
    import termios
    import threading

    config = _tiny_config(tmp_path, xe_epochs=2, batch_size=10, log_every=1)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal of 120 columns
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the pty closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    done = subprocess.run([sys.executable, "-m", "launch.cli", "train", "--config", config], cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=slave, text=True, timeout=600)
    os.close(slave)
    reader.join(10)
    os.close(master)
    shown = b"".join(chunks).decode(errors="replace")
    assert done.returncode == 0, shown[-3000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines()[:2]] == ["epoch 1", "epoch 2"]
    steps = json.loads((tmp_path / "runs/a2/history.json").read_text())[0]["step"]  # steps of epoch 1
    assert "epoch 1 (xe):" in shown and "epoch 2 (xe):" in shown, shown[-2000:]  # a bar per epoch
    assert f"| {steps}/{steps} [" in shown and "step/s" in shown and "loss=" in shown, shown[-2000:]
    assert " step 1 (1/" not in shown  # no step lines on a terminal: the bar is their view


def test_train_logs_step_lines_without_a_terminal(tmp_path):
    """Without a terminal (a log file, a pipe), the `train.log_every` step lines reach stderr, with the step within
    the epoch; stdout keeps one line per epoch."""
    config = _tiny_config(tmp_path, batch_size=10, log_every=2)
    done = a2_train("--config", config, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    steps = json.loads((tmp_path / "runs/a2/history.json").read_text())[0]["step"]
    lines = [line for line in done.stderr.splitlines() if " INFO epoch 1 step " in line]
    assert [line.split(" INFO ")[1].split(" loss ")[0] for line in lines] == \
        [f"epoch 1 step {s} ({s}/{steps} of the epoch)" for s in range(2, steps + 1, 2)]
    assert all(float(line.split(" loss ")[1].split()[0]) > 0 for line in lines)
    assert done.stdout.splitlines()[0].startswith("epoch 1: train/loss ")


def test_a_killed_train_keeps_its_history_up_to_its_last_epoch(tmp_path):
    """history.json is written (whole, atomically) as each epoch ends, so `a2 train` killed part way leaves the
    epochs before the kill next to last.pt, not only checkpoints."""
    import signal
    import time

    config = _tiny_config(tmp_path, xe_epochs=40, test_at_end=False)
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "train", "--config", config], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    history = tmp_path / "runs/a2/history.json"
    try:
        deadline = time.monotonic() + 300
        while not history.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        running = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert running, "history.json appeared only when the run had ended"
    epochs = [h["epoch"] for h in json.loads(history.read_text())]
    assert epochs == list(range(1, len(epochs) + 1)) and 1 <= len(epochs) < 40
    assert (tmp_path / "runs/a2/last.pt").is_file()


def test_a_resumed_train_goes_on_in_its_own_folder_and_never_over_another_run(tmp_path):
    """`a2 train --resume runs/a2-2/last.pt` continues run 2 in runs/a2-2 (it wrote into the configured runs/a2
    before: run 1's checkpoints, history and test scores replaced by run 2's); given another run's folder, it gets a
    new numbered one and reads its best checkpoint so far from its own."""
    from launch.commands.local import resumed_output

    config = _tiny_config(tmp_path)
    for _ in range(2):
        assert a2_train("--config", config, cwd=tmp_path).returncode == 0
    first = {name: (tmp_path / "runs/a2" / name).read_bytes() for name in ("best.pt", "last.pt", "history.json")}
    resumed = a2_train("--config", config, "--resume", "runs/a2-2/last.pt", "train.xe_epochs=2", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert [h["epoch"] for h in json.loads((tmp_path / "runs/a2-2/history.json").read_text())] == [1, 2]
    assert {name: (tmp_path / "runs/a2" / name).read_bytes() for name in first} == first  # run 1 untouched
    assert "checkpoint: runs/a2-2/best.pt" in resumed.stdout

    own = tmp_path / "runs/a2-2"
    assert resumed_output(str(own / "last.pt"), None, "runs/a2") == (own, None)
    out, best = resumed_output(str(own / "last.pt"), str(tmp_path / "runs/a2"), "runs/a2")
    assert out == tmp_path / "runs/a2-3" and best == own / "best.pt"
    # its best.pt, an earlier epoch than its last.pt: in place it wrote over the later last.pt and history
    out, best = resumed_output(str(own / "best.pt"), None, "runs/a2")
    assert out == tmp_path / "runs/a2-2-2" and best == own / "best.pt"
    kept = {name: (own / name).read_bytes() for name in ("last.pt", "history.json")}
    again = a2_train("--config", config, "--resume", "runs/a2-2/best.pt", "train.xe_epochs=2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert {name: (own / name).read_bytes() for name in kept} == kept and (tmp_path / "runs/a2-2-2/last.pt").is_file()
    missing = a2_train("--config", config, "--resume", "runs/nope/last.pt", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "a2: error: --resume runs/nope/last.pt: no such checkpoint file"]
