"""The built-in vision task (`--task shapes`, cohort_grpo/tasks/shapes.py): its answers are the pictures' own (counted
here from the pixels), its held-out split is disjoint from train, its grader is exact, and a two-step command-line
run on the tiny vision-language model samples with the images and evaluates the held-out split."""

import subprocess
import sys

import numpy as np
import pytest

from cohort_grpo.errors import CohortError
from cohort_grpo.tasks import get_task
from cohort_grpo.tasks.shapes import COLOURS


def blobs(image, colour) -> int:
    """Connected regions (4-neighbours) of exactly `colour`'s pixels: the shapes of that colour, counted from the
    picture alone."""
    pixels = np.all(np.asarray(image) == np.array(colour, dtype=np.uint8), axis=-1)
    seen, count = np.zeros_like(pixels), 0
    for start in zip(*np.nonzero(pixels)):
        if seen[start]:
            continue
        count += 1
        stack = [start]
        seen[start] = True
        while stack:
            y, x = stack.pop()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < pixels.shape[0] and 0 <= nx < pixels.shape[1] and pixels[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def test_answers_are_the_pictures_counts_and_splits_are_disjoint():
    task = get_task("shapes")
    train, test = task.load("train", size=60, seed=3), task.load("test", size=60)
    assert test == task.load("test", size=60)  # the held-out split does not move
    assert not {r["question"] for r in train} & {r["question"] for r in task.load("test", size=200)}
    answers = set()
    for row in train[:30]:
        colour = row["prompt"][0]["content"][1]["text"].split()[2]
        assert row["solution"] == str(blobs(row["image"], COLOURS[colour]))
        answers.add(row["solution"])
    assert len(answers) > 2  # counts vary, 0 among them
    row = train[0]
    assert task.is_correct(f"<answer>{row['solution']}</answer>", row)
    assert not task.is_correct(f"<answer>{int(row['solution']) + 1}</answer>", row)
    with pytest.raises(CohortError, match="splits train/test/validation"):
        task.load("dev")


def test_two_steps_from_the_command_line(tmp_path):
    """`cohort-grpo train --task shapes`: the tiny vision-language model, sampled with each prompt's picture, two
    steps and the held-out evaluation before and after."""
    out = subprocess.run([sys.executable, "-m", "cohort_grpo", "train", "--task", "shapes", "--max_steps", "2",
                          "--device", "cpu", "--output_dir", str(tmp_path / "run"), "--per_device_train_batch_size",
                          "8", "--eval_limit", "6"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "vision-language path" in text and "Step 2/2" in text
    assert "held-out accuracy" in text and "(6 problems)" in text
