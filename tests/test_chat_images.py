"""Images in `cohort-grpo chat` (cli/chat_images.py): a reply with an image is the engine's greedy completion of the
same prompt and image as training renders it (rollout/images.py), turn after turn (a text turn after an image runs
only its new tokens, a turn with a new image starts over with both), for a tiny random Qwen2.5-VL, Gemma 3 and
Qwen3.5; the flag and the /image command, and the one-line errors of a text model, a missing file, --raw and tools."""

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cohort_grpo.cli.chat import ChatSession, chat_loop
from cohort_grpo.cli.chat_images import image_command_path
from cohort_grpo.errors import CohortError, command_line
from cohort_grpo.models.policy import save_policy
from cohort_grpo.models.tiny_vision import build_vision_model
from cohort_grpo.rollout.engine import Engine
from cohort_grpo.rollout.images import ImagePrompts, load_image
from cohort_grpo.rollout.sampler import SamplingParams
from cohort_grpo.run.policy import load_policy
from test_vision_language import processor_or_skip

pytestmark = pytest.mark.cpu("float32 greedy tokens of CPU forwards")

REPO_ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 10


def write_image(path: Path, seed: int, size=(70, 84)) -> str:
    from PIL import Image

    Image.fromarray(np.random.RandomState(seed).randint(0, 256, (*size, 3)).astype("uint8")).save(path)
    return str(path)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "gemma3", "qwen3_5"])
def vision(request):
    torch.set_num_threads(1)
    processor = processor_or_skip(request.param)
    model, tokenizer = load_policy(build_vision_model(processor.tokenizer, seed=3, family=request.param).eval(),
                                   processor, log=lambda line: None)
    return model.eval(), tokenizer


def engine_reply(model, tokenizer, conversation: list[dict], paths: list[str]) -> str:
    """What the trainer's sampler makes of the conversation: rendered by `ImagePrompts` with the images, greedy in
    the engine, decoded up to EOS."""
    ids, inputs = ImagePrompts.of(model).encode(conversation, [load_image(path) for path in paths])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, eos_token_ids=[tokenizer.eos_token_id],
                            pad_token_id=tokenizer.pad_token_id)
    rollout = Engine(model, max_batch_size=1).generate([ids], 1, params, images=[inputs])
    completion = rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist()
    return tokenizer.decode([t for t in completion if t != tokenizer.eos_token_id], skip_special_tokens=True).strip()


def user(text: str, images: int = 0):
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}


def test_replies_with_images_are_the_engines_greedy_completions(vision, tmp_path):
    """Turn 1 with an image, turn 2 text only (the cache keeps the image's prefill: the vision tower does not run
    again), turn 3 with a second image (the conversation runs again with both): each reply is the engine's greedy
    completion of the whole conversation with its images."""
    model, tokenizer = vision
    first, second = write_image(tmp_path / "a.png", 0), write_image(tmp_path / "b.png", 1, (56, 98))
    session = ChatSession(model, tokenizer, temperature=0.0, max_new_tokens=NEW_TOKENS)
    tower_calls = []
    hook = model.vision_tower.register_forward_hook(lambda *args: tower_calls.append(1))
    try:
        session.attach_image(first, "--image")
        replies = [session.reply("how many? ")]
        after_first = session.decoder.forwards
        replies.append(session.reply("and red? "))
        text_turn_forwards = session.decoder.forwards - after_first
        assert len(tower_calls) == 1  # the text turn reused the cached image
        session.attach_image(second)
        replies.append(session.reply("which differs? "))
        assert len(tower_calls) == 2
    finally:
        hook.remove()
    assert text_turn_forwards <= NEW_TOKENS  # one prefill of the new tokens, then one forward per token
    conversation, expected = [], []
    for text, images, paths in (("how many? ", 1, [first]), ("and red? ", 0, [first]),
                                ("which differs? ", 1, [first, second])):
        conversation.append(user(text, images))
        expected.append(engine_reply(model, tokenizer, conversation, paths))
        conversation.append({"role": "assistant", "content": expected[-1]})
    assert replies == expected
    assert all(len(reply) >= 3 for reply in replies)  # replies with tokens in them, not an immediate EOS
    assert replies[0] != ChatSession(model, tokenizer, temperature=0.0, max_new_tokens=NEW_TOKENS).reply("how many? ")


def test_reset_forgets_the_images_and_a_new_image_is_not_mistaken_for_the_old(vision, tmp_path):
    """After /reset a conversation with another image of the same size (the same tokens) gets that image's reply."""
    model, tokenizer = vision
    first, other = write_image(tmp_path / "a.png", 0), write_image(tmp_path / "c.png", 2)
    session = ChatSession(model, tokenizer, temperature=0.0, max_new_tokens=NEW_TOKENS)
    session.attach_image(first)
    session.reply("how many? ")
    session.attach_image(first)
    session.reset()  # pending images go too
    assert session.images.pending == []
    session.attach_image(other)
    assert session.reply("how many? ") == engine_reply(model, tokenizer, [user("how many? ", 1)], [other])


def test_image_command_in_the_chat_loop_and_its_errors_keep_the_chat_going(vision, tmp_path):
    model, tokenizer = vision
    path = write_image(tmp_path / "a b.png", 0)
    session = ChatSession(model, tokenizer, temperature=0.0, max_new_tokens=NEW_TOKENS)
    out, err = io.StringIO(), io.StringIO()
    lines = f"/image {tmp_path / 'missing.png'}\n/image '{path}'\nhow many? \n/exit\n"
    assert chat_loop(session, io.StringIO(lines), out, err, interactive=True) == 0
    assert "/image PATH attaches an image" in err.getvalue()
    assert f"cohort: error: /image {tmp_path / 'missing.png'}: no such file" in err.getvalue()
    assert f"(image {path} attached to the next message)" in err.getvalue()
    assert out.getvalue().count("model> ") == 1
    reply = out.getvalue().split("model> ")[1].split("\n")[0].strip()
    assert reply == engine_reply(model, tokenizer, [user("how many?", 1)], [path])  # the line, stripped
    assert image_command_path('/image "x y.png"') == "x y.png" and image_command_path("/image") == ""


def test_images_are_refused_in_one_line_where_they_cannot_go(vision, tiny_text, tmp_path):
    model, tokenizer = vision
    path = write_image(tmp_path / "a.png", 0)
    text_model, text_tokenizer = tiny_text
    with pytest.raises(CohortError, match=r"^--image needs a vision-language model \(Qwen-VL, Gemma 3, SmolVLM, LLaVA, \.\.\.\); "
                                          r"this llama "
                                          r"model reads text only: chat with a vision-language model folder, or drop --image$"):
        ChatSession(text_model, text_tokenizer).attach_image(path, "--image")
    session = ChatSession(model, tokenizer)
    with pytest.raises(CohortError, match=r"^/image .*missing\.png: no such file; give the path of an image file"):
        session.attach_image(str(tmp_path / "missing.png"))
    (tmp_path / "notes.png").write_text("not a picture")
    with pytest.raises(CohortError, match=r"notes\.png: not an image file PIL can read"):
        session.attach_image(str(tmp_path / "notes.png"))
    with pytest.raises(CohortError, match=r"^/image needs a path: /image PATH"):
        session.attach_image("")
    with pytest.raises(CohortError, match=r"^--image: --raw completes each line as it is.*drop --raw$"):
        ChatSession(model, tokenizer, raw=True).attach_image(path, "--image")
    tools = ChatSession(model, tokenizer)
    tools.tool_schemas = []
    with command_line(), pytest.raises(CohortError, match=r"^/image: images with tools are not supported yet: chat "
                                                         r"with --tools none"):
        tools.attach_image(path)
    assert session.images.pending == []


@pytest.fixture(scope="module")
def tiny_text():
    from cohort_grpo.models.tiny import TINY_SPEC, build_model, build_tokenizer

    tokenizer = build_tokenizer()
    return build_model(tokenizer, seed=0, spec=TINY_SPEC).eval(), tokenizer


def chat_command(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "cohort_grpo", "chat", *args], input=stdin.encode(), cwd=REPO_ROOT,
                          env=env, capture_output=True, timeout=300)


def test_chat_command_with_a_saved_vision_folder_and_image_flags(tiny_text, tmp_path):
    """`cohort-grpo chat FOLDER --image A --image B` (a saved cohort:tiny-vision, as `--task shapes` writes it)
    answers from a pipe with the engine's greedy reply to both images in the first message; a missing file and a
    text model are one line each, exit code 2."""
    model, tokenizer = load_policy("cohort:tiny-vision", log=lambda line: None)
    folder = tmp_path / "vision"
    save_policy(model, tokenizer, folder)
    model, tokenizer = load_policy(str(folder), log=lambda line: None)  # the folder loads back with its processor
    first, second = write_image(tmp_path / "a.png", 0), write_image(tmp_path / "b.png", 1)
    done = chat_command([str(folder), "--image", first, "--image", second, "--temperature", "0",
                         "--max_new_tokens", str(NEW_TOKENS)], "how many?\n")
    assert done.returncode == 0, done.stderr.decode()
    expected = engine_reply(model.eval(), tokenizer, [user("how many?", 2)], [first, second])
    assert done.stdout.decode() == expected + "\n"
    missing = chat_command([str(folder), "--image", str(tmp_path / "nope.png")], "")
    assert missing.returncode == 2
    assert missing.stderr.decode().strip().splitlines()[-1] == (
        f"cohort: error: --image {tmp_path / 'nope.png'}: no such file; give the path of an image file (PNG, JPEG, ...)")
    text_folder = tmp_path / "text"
    text_model, text_tokenizer = tiny_text
    text_model.save_pretrained(text_folder)
    text_tokenizer.save_pretrained(text_folder)
    text = chat_command([str(text_folder), "--image", first], "")
    assert text.returncode == 2
    assert text.stderr.decode().strip().splitlines()[-1].startswith(
        "cohort: error: --image needs a vision-language model (Qwen-VL, Gemma 3, SmolVLM, LLaVA, ...);")
