"""`cohort-grpo chat` / `cohort-grpo generate`: incremental decoding equals full recomputation, the chat format,
history and /reset, streaming, a pipe, and batch generation to JSONL."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cohort_grpo.cli.chat import CachedDecoder, ChatSession, TextStream, chat_loop, format_messages
from cohort_grpo.cli.generate import generate_main, read_prompts
from cohort_grpo.errors import CohortError
from cohort_grpo.models import from_pretrained, load_tokenizer
from cohort_grpo.models.tiny import TINY_SPEC, build_model, build_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
SIMPLE_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_tiny(path: Path, max_positions: int = 128, chat_template: str | None = None) -> str:
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    if chat_template:
        tokenizer.chat_template = chat_template
    build_model(tokenizer, seed=0, spec={**TINY_SPEC, "max_position_embeddings": max_positions}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    torch.set_num_threads(1)
    return from_pretrained(tiny_dir).eval(), load_tokenizer(tiny_dir)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1]


def greedy_reference(model, tokenizer, prompt_ids: list[int], max_new: int) -> list[int]:
    """Greedy decoding that re-runs the whole sequence for every token (no cache): the slow truth."""
    ids, out = list(prompt_ids), []
    for _ in range(max_new):
        token = int(full_logits(model, ids).argmax())
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
        ids.append(token)
    return out


def test_cached_decoding_equals_full_recomputation_through_rewind_and_growth(tmp_path):
    torch.set_num_threads(1)
    folder = save_tiny(tmp_path / "long", max_positions=512)
    model = from_pretrained(folder).eval()
    torch.manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (300,)).tolist()
    decoder = CachedDecoder(model)
    assert torch.allclose(decoder.extend(ids[:100]), full_logits(model, ids[:100]), atol=1e-4)
    first_size = decoder.cache.max_len
    for n in range(101, 104):  # token by token
        assert torch.allclose(decoder.extend([ids[n - 1]]), full_logits(model, ids[:n]), atol=1e-4)
    decoder.rewind(80)  # an edited history: keep the shared prefix, run only what differs
    other = ids[:80] + ids[150:160]
    assert torch.allclose(decoder.extend(ids[150:160]), full_logits(model, other), atol=1e-4)
    assert first_size == 256  # the first cache holds 256 positions ...
    decoder.extend(ids[160:300])  # ... 90 + 140 = 230 still fit
    grown = other + ids[160:300] + ids[:40]  # 270 do not: the cache grows and the history runs again
    assert torch.allclose(decoder.extend(ids[:40]), full_logits(model, grown), atol=1e-4)
    assert decoder.cache.max_len > first_size


def test_greedy_reply_equals_full_recomputation_and_costs_one_forward_per_token(tiny):
    model, tokenizer = tiny
    session = ChatSession(model, tokenizer, max_new_tokens=12, temperature=0.0, notice=lambda m: None)
    pieces = []
    answer = session.reply("12+3=?", pieces.append)
    prompt_ids = tokenizer(format_messages(tokenizer, [{"role": "user", "content": "12+3=?"}]),
                           add_special_tokens=False)["input_ids"]
    expected = greedy_reference(model, tokenizer, prompt_ids, 12)
    raw = tokenizer.decode(expected, skip_special_tokens=True).split("\nUser:")[0]
    assert "".join(pieces) == raw  # what was streamed is the reply, piece by piece
    assert answer == raw.strip()
    generated = len(session.decoder.tokens) - len(prompt_ids)
    assert session.decoder.forwards == 1 + generated  # one prefill, then one single-token forward per token


def test_a_second_turn_runs_only_the_new_tokens_and_sees_the_history(tiny):
    model, tokenizer = tiny
    session = ChatSession(model, tokenizer, max_new_tokens=6, temperature=0.0, notice=lambda m: None)
    session.reply("1+1=?")
    fed = []
    extend = session.decoder.extend
    session.decoder.extend = lambda ids: fed.append(len(ids)) or extend(ids)
    session.reply("2+2=?")
    conversation = format_messages(tokenizer, session.history[:3])  # both turns, ending at "Assistant:"
    assert conversation.startswith("User: 1+1=?\nAssistant: ") and conversation.endswith("User: 2+2=?\nAssistant:")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert session.decoder.tokens[: len(encode(conversation))] == encode(conversation)
    # the first turn's prompt was already in the cache: at most the rest of the conversation ran again
    assert fed[0] <= len(encode(conversation)) - len(encode("User: 1+1=?\nAssistant:"))
    assert len(session.history) == 4 and session.history[2] == {"role": "user", "content": "2+2=?"}


def test_reset_forgets_the_history(tiny):
    model, tokenizer = tiny
    fresh = ChatSession(model, tokenizer, max_new_tokens=8, temperature=0.0, notice=lambda m: None)
    session = ChatSession(model, tokenizer, max_new_tokens=8, temperature=0.0, notice=lambda m: None)
    session.reply("5+5=?")
    session.reset()
    assert session.history == []
    assert session.reply("7+1=?") == fresh.reply("7+1=?")


def test_chat_template_or_plain_user_assistant_lines(tmp_path, tiny):
    _, plain = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2=?"}]
    assert format_messages(plain, messages) == "System: Be brief.\nUser: hi\nAssistant: hello\nUser: 2+2=?\nAssistant:"
    templated = load_tokenizer(save_tiny(tmp_path / "templated", chat_template=SIMPLE_TEMPLATE))
    assert format_messages(templated, messages[1:2]) == "<user>hi<eos><assistant>"
    model = from_pretrained(str(tmp_path / "templated")).eval()
    session = ChatSession(model, templated, system="Be brief.", max_new_tokens=4, temperature=0.0, notice=print)
    session.reply("hi")
    assert session.stops == []  # a template ends turns with a token, not a "User:" line
    expected = templated("<system>Be brief.<eos><user>hi<eos><assistant>", add_special_tokens=False)["input_ids"]
    assert session.decoder.tokens[: len(expected)] == expected


def test_stream_holds_back_half_a_stop_string_and_cuts_at_it(tiny):
    _, tokenizer = tiny
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731 - one token a char
    stream = TextStream(tokenizer, ["\nUser:"])
    shown = "".join(stream.push(t) for t in ids("ab\nUs"))
    assert shown == "ab" and not stream.stopped
    shown += "".join(stream.push(t) for t in ids("er: more"))
    assert stream.stopped and shown + stream.finish() == "ab"
    stream = TextStream(tokenizer, ["\nUser:"])
    shown = "".join(stream.push(t) for t in ids("ab\nUx"))
    assert shown + stream.finish() == "ab\nUx"  # not a stop string after all: released


def test_raw_mode_completes_each_line_as_a_training_prompt_without_history(tiny):
    model, tokenizer = tiny
    session = ChatSession(model, tokenizer, max_new_tokens=6, temperature=0.0, raw=True, notice=print)
    prompt = "12+7=? Reply <answer>N</answer>"
    answer = session.reply(prompt)
    expected = greedy_reference(model, tokenizer, tokenizer(prompt + "\n", add_special_tokens=False)["input_ids"], 6)
    assert answer == tokenizer.decode(expected, skip_special_tokens=True).strip()
    assert session.history == [] and session.stops == []


def test_a_long_conversation_drops_the_oldest_exchange_instead_of_failing(tiny):
    model, tokenizer = tiny
    notices = []
    session = ChatSession(model, tokenizer, max_new_tokens=16, temperature=0.0, notice=notices.append)
    for i in range(6):
        session.reply(f"what is {i}+{i}+{i}+{i}+{i}+{i}+{i}?")
        assert len(session.decoder.tokens) <= model.config.max_position_embeddings
    assert notices and "dropped the oldest exchange" in notices[0]
    with pytest.raises(CohortError, match="more than the model's 128-token context"):
        session.reply("9" * 200)


@pytest.mark.slow
def test_chat_from_a_pipe_prints_the_replies_and_exits_zero(tiny_dir, tiny):
    model, tokenizer = tiny
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "TERM": "xterm-256color"}
    result = subprocess.run(
        [sys.executable, "-m", "cohort_grpo", "chat", tiny_dir, "--temperature", "0", "--max_new_tokens", "10"],
        input=b"hi\n/reset\n\nhello\n/exit\nnever read\n", cwd=REPO_ROOT, env=env, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()
    expected = []
    for message in ("hi", "hello"):  # /reset between them: each is a fresh conversation
        pieces = []
        ChatSession(model, tokenizer, max_new_tokens=10, temperature=0.0, notice=print).reply(message, pieces.append)
        expected.append("".join(pieces) + "\n")
    out = result.stdout.decode("utf-8")
    assert out == "".join(expected)  # only the replies: no prompts, no ANSI codes
    assert "\x1b" not in out and "(history cleared)" in result.stderr.decode()


def test_chat_loop_ends_at_end_of_input_and_prompts_only_when_interactive(tiny):
    import io

    model, tokenizer = tiny
    session = ChatSession(model, tokenizer, max_new_tokens=3, temperature=0.0, notice=print)
    out, err = io.StringIO(), io.StringIO()
    assert chat_loop(session, io.StringIO("1+1\n"), out, err, interactive=True) == 0
    assert out.getvalue().startswith("you> model> ") and out.getvalue().endswith("you> ")
    assert "/reset" in err.getvalue()


@pytest.mark.slow
def test_generate_writes_one_row_per_completion(tmp_path, tiny_dir, tiny, capsys):
    model, tokenizer = tiny
    txt = tmp_path / "prompts.txt"
    txt.write_text("12+7=? Reply <answer>N</answer>\n\n3+4=?\n")
    out = tmp_path / "out.jsonl"
    assert generate_main([tiny_dir, "--prompts", str(txt), "--output", str(out), "--num_generations", "2",
                          "--max_new_tokens", "6", "--temperature", "0"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 0, 1, 1]
    # a .txt line is a prompt with its newline, as training prompts end
    assert [r["prompt"] for r in rows[::2]] == ["12+7=? Reply <answer>N</answer>\n", "3+4=?\n"]
    for row in rows:
        assert set(row) == {"index", "prompt", "completion", "finish_reason", "num_tokens"}
        reference = greedy_reference(model, tokenizer, tokenizer(row["prompt"], add_special_tokens=False)["input_ids"], 6)
        assert row["completion"] == tokenizer.decode(reference, skip_special_tokens=True)
        assert row["finish_reason"] == ("length" if len(reference) == 6 else "stop")
        assert row["num_tokens"] == min(len(reference) + 1, 6)  # the EOS counts as generated
    assert "wrote 4 completions" in capsys.readouterr().err

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1=?"}]}) + "\n"
                     + json.dumps({"prompt": "2+2=?", "other": 1}) + "\n")
    assert generate_main([tiny_dir, "--prompts", str(jsonl), "--max_new_tokens", "3", "--temperature", "0"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in printed] == [[{"role": "user", "content": "1+1=?"}], "2+2=?"]


def test_bad_prompt_files_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "no prompt"}\n')
    with pytest.raises(CohortError, match=r"bad\.jsonl line 2 has no 'prompt'"):
        read_prompts(bad)
    with pytest.raises(CohortError, match="no such file"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "lines.txt").write_text("a\n\nb")  # the last line has no newline in the file: it gets one
    assert read_prompts(tmp_path / "lines.txt") == ["a\n", "b\n"]
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(CohortError, match="holds no prompts"):
        read_prompts(tmp_path / "empty.txt")


@pytest.mark.slow
def test_generate_completes_a_file_of_arithmetic_prompts_as_the_task_does(tmp_path, capsys):
    """The built-in model answers after the prompt's newline: a .txt file of the arithmetic task's prompts
    (one a line) gets exactly the completions of the task's own prompt strings, and they are answers."""
    from cohort_grpo.cli.chat import load_for_inference
    from cohort_grpo.cli.generate import generate_rows
    from cohort_grpo.sft.builtin import tiny_model_dir
    from cohort_grpo.tasks import get_task

    rows = get_task("arithmetic").load("test", levels=[2], size=6)
    assert all(r["prompt"].endswith("\n") for r in rows)
    txt = tmp_path / "prompts.txt"
    txt.write_text("".join(r["prompt"] for r in rows))
    model_dir = str(tiny_model_dir(log=lambda *_: None))
    assert generate_main([model_dir, "--prompts", str(txt), "--max_new_tokens", "8", "--temperature", "0",
                          "--device", "cpu"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    model, tokenizer, _ = load_for_inference(model_dir, "cpu")
    expected = list(generate_rows(model, tokenizer, [r["prompt"] for r in rows], model_spec=model_dir,
                                  max_new_tokens=8, temperature=0.0))
    assert [r["completion"] for r in printed] == [r["completion"] for r in expected]
    assert all(r["completion"].startswith("<answer>") for r in printed), printed  # not empty, as before


@pytest.mark.slow
def test_chat_with_the_real_smollm2_gguf_from_a_pipe(smollm2_gguf):
    """SmolLM2 as tests/conftest.py's `smollm2_gguf` fetches it (skipped, naming where it looked, without it)."""
    result = subprocess.run(
        [sys.executable, "-m", "cohort_grpo", "chat", smollm2_gguf, "--temperature", "0", "--max_new_tokens", "24"],
        input=b"What is the capital of France? Answer in one word.\n", cwd=REPO_ROOT, capture_output=True,
        timeout=600)
    assert result.returncode == 0, result.stderr.decode()
    assert "paris" in result.stdout.decode().lower()


def test_models_cohort_does_not_implement_decode_with_transformers_cache():
    """A Hugging Face model (GPT-2 here, not one of cohort's own) decodes through past_key_values."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=2)).eval()
    ids = torch.randint(0, 50, (40,)).tolist()
    decoder = CachedDecoder(model)
    assert not decoder.own
    hf_logits = lambda seq: model(torch.tensor([seq])).logits[0, -1]  # noqa: E731
    with torch.no_grad():
        assert torch.allclose(decoder.extend(ids[:20]), hf_logits(ids[:20]), atol=1e-5)
        assert torch.allclose(decoder.extend([ids[20]]), hf_logits(ids[:21]), atol=1e-5)
        decoder.rewind(10)
        assert torch.allclose(decoder.extend(ids[30:35]), hf_logits(ids[:10] + ids[30:35]), atol=1e-5)
        decoder.rewind(0)
        assert torch.allclose(decoder.extend(ids[:3]), hf_logits(ids[:3]), atol=1e-5)
