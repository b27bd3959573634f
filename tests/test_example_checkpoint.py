"""examples/train_digits.py --checkpoint-dir / --resume on 2 ranks under mpirun.

Only rank 0 prints results and writes checkpoints (one complete file per epoch, nothing left
half-written); --resume starts afresh where there is no checkpoint yet, and a resumed job
continues from the latest checkpoint's epoch with replicas that stay identical.
"""

import os
import re

import pytest

from launch import launcher_available, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")
BOUND = 240  # seconds per job; a job still running then is killed and the test fails


TAG = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr)>:")


def rank_lines(output):
    """{rank: [lines]} from mpirun --tag-output's "[job,rank]<stdout>:" prefixes.

    Open MPI tags every write it forwards, and an unbuffered print() writes its text and its
    newline separately, so a line can read "[1,0]<stdout>:text[1,0]<stdout>:"; the tags are
    removed wherever they are, and the line belongs to the rank of its first tag.
    """
    lines = {}
    for line in output.splitlines():
        match = TAG.match(line)
        if match:
            lines.setdefault(int(match.group(1)), []).append(TAG.sub("", line))
    return lines


def run_example(*args):
    result = run_job("mpirun", 2, [EXAMPLE, *args], timeout=BOUND)
    assert not result.timed_out, f"the example hung:\n{result.output[-5000:]}"
    assert result.returncode == 0, result.output[-5000:]
    return result


def rank0_only(output, pattern):
    """The lines matching ``pattern``: all printed by rank 0, none by rank 1."""
    lines = rank_lines(output)
    assert not any(re.search(pattern, line) for line in lines.get(1, [])), \
        f"rank 1 printed {pattern!r}:\n{output[-5000:]}"
    return [line for line in lines.get(0, []) if re.search(pattern, line)]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_rank0_checkpoints_and_resume(tmp_path):
    reason = launcher_available("mpirun")
    if reason:
        pytest.skip(reason)
    checkpoints = tmp_path / "ckpt"

    # --resume with no checkpoint yet starts afresh (what a requeued batch job relies on).
    first = run_example("--epochs", "2", "--checkpoint-dir", str(checkpoints), "--resume")
    out = first.output
    assert len(rank0_only(out, r"^no checkpoint in .*: starting at epoch 1$")) == 1, out[-5000:]
    assert rank0_only(out, r"^Epoch \d+/2$") == ["Epoch 1/2", "Epoch 2/2"], out[-5000:]
    assert len(rank0_only(out, r"^test accuracy: ")) == 1, out[-5000:]
    assert rank0_only(out, r"^replicas identical: ") == ["replicas identical: True"], out[-5000:]
    assert len(rank0_only(out, r"^checkpoints: rank 0 writes ")) == 1, out[-5000:]
    # One complete file per epoch; no partial file left behind.
    assert sorted(os.listdir(checkpoints)) == ["epoch-001.keras", "epoch-002.keras"]

    second = run_example("--epochs", "3", "--checkpoint-dir", str(checkpoints), "--resume")
    out = second.output
    resumed = rank0_only(out, r"^resuming from ")
    assert len(resumed) == 1 and resumed[0].startswith(f"resuming from {checkpoints / 'epoch-002.keras'}"), \
        out[-5000:]
    # Keras counts on from the checkpoint's epoch: only the third epoch runs.
    assert rank0_only(out, r"^Epoch \d+/\d+$") == ["Epoch 3/3"], out[-5000:]
    accuracy = rank0_only(out, r"^test accuracy: ")
    assert len(accuracy) == 1 and float(accuracy[0].split(": ")[1]) > 0.5, out[-5000:]
    assert rank0_only(out, r"^replicas identical: ") == ["replicas identical: True"], out[-5000:]
    assert sorted(os.listdir(checkpoints)) == ["epoch-001.keras", "epoch-002.keras", "epoch-003.keras"]
    print(f"first run {first.seconds:.1f} s, resumed run {second.seconds:.1f} s, {accuracy[0]}")

