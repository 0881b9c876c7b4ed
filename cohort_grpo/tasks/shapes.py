"""A built-in vision task: count the shapes of one colour in a drawn image (no download).

Each problem is a small picture of a few circles, squares and triangles in a few colours, drawn with PIL on a white
canvas, and the question "How many <colour> shapes?"; the answer is the count, 0 included, in <answer>N</answer>
(graded exactly, as the arithmetic task grades). The prompt is a chat turn with an image part and the row's
`image` column holds the picture, as a TRL vision dataset has them, so the task trains any vision-language model
cohort serves (`cohort-grpo train --task shapes`: the tiny random Qwen2.5-VL of models/tiny_vision.py by default).
Train and test draw from disjoint random streams and the test layouts are removed from train, so the held-out
accuracy is of pictures never trained on.
"""

from __future__ import annotations

import random

from cohort_grpo.errors import CohortError
from cohort_grpo.tasks.arithmetic import answer_reward, extract_answer, split_random

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220)}
KINDS = ("circle", "square", "triangle")
CANVAS = 84  # pixels a side: 6 × 6 patches of 14, 3 × 3 image tokens after the 2 × 2 merge
SHAPE_SIZE = 18
MAX_SHAPES = 5
QUESTION = "How many {colour} shapes? Reply <answer>N</answer>"


def make_layout(rng: random.Random) -> tuple[tuple[str, str, int, int], ...]:
    """A picture's shapes, as (kind, colour, x, y) of each top-left corner, on a 3 × 3 grid of cells (one shape
    a cell, jittered within it, so no two overlap)."""
    count = rng.randint(1, MAX_SHAPES)
    cells = rng.sample(range(9), count)
    cell = CANVAS // 3
    layout = []
    for index in sorted(cells):
        x = (index % 3) * cell + rng.randint(0, cell - SHAPE_SIZE)
        y = (index // 3) * cell + rng.randint(0, cell - SHAPE_SIZE)
        layout.append((rng.choice(KINDS), rng.choice(list(COLOURS)), x, y))
    return tuple(layout)


def draw(layout) -> "object":
    """The picture of `layout`: an RGB PIL image, CANVAS pixels a side, white background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (CANVAS, CANVAS), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for kind, colour, x, y in layout:
        box = (x, y, x + SHAPE_SIZE - 1, y + SHAPE_SIZE - 1)
        fill = COLOURS[colour]
        if kind == "circle":
            pen.ellipse(box, fill=fill)
        elif kind == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(x + SHAPE_SIZE // 2, y), (x, y + SHAPE_SIZE - 1), (x + SHAPE_SIZE - 1, y + SHAPE_SIZE - 1)],
                        fill=fill)
    return image


class ShapesTask:
    name = "shapes"
    # `cohort-grpo train --task shapes`: the tiny random vision-language model (no warm start: a first run shows the
    # path works; a real one names --model Qwen/Qwen2.5-VL-3B-Instruct), short completions.
    default_config = dict(
        model="cohort:tiny-vision", num_generations=4, per_device_train_batch_size=16, gradient_accumulation_steps=1,
        max_completion_length=12, max_prompt_length=128, learning_rate=1e-4, beta=0.0, max_steps=50, temperature=1.0,
        eval_limit=50, output_dir="runs/shapes", seed=0, logging_steps=5, log_completions_steps=25,
    )
    reads_data = False  # it draws its problems: --data_files / --dataset_name do not apply
    system_prompt = None
    reward_funcs = [answer_reward]
    reward_weights = [1.0]
    extract_answer = staticmethod(extract_answer)

    def load(self, split: str = "train", *, size: int = 1000, seed: int = 0, **_) -> list[dict]:
        """Rows {prompt (a chat turn with an image part), image, solution, question}. The test split does not depend
        on the seed, and no train row repeats a test row's picture and question."""
        rng = split_random("shapes", split, seed)
        if not isinstance(size, int) or size < 1:
            raise CohortError(f"shapes: size must be a positive number of problems, got {size!r}")
        held_out = set() if split == "test" else {row["question"] for row in self.load("test", size=200)}
        rows = []
        for _ in range(50 * size):
            if len(rows) == size:
                break
            layout, colour = make_layout(rng), rng.choice(list(COLOURS))
            key = repr((layout, colour))
            if key in held_out:
                continue
            count = sum(shape_colour == colour for _, shape_colour, _, _ in layout)
            prompt = [{"role": "user", "content": [{"type": "image"},
                                                   {"type": "text", "text": QUESTION.format(colour=colour)}]}]
            rows.append({"prompt": prompt, "image": draw(layout), "solution": str(count), "question": key})
        return rows

    def is_correct(self, completion: str, row: dict) -> bool:
        return answer_reward(None, [completion], solution=[row["solution"]])[0] == 1.0

    @staticmethod
    def solved_completion(row: dict) -> str:
        return f"<answer>{row['solution']}</answer>"
