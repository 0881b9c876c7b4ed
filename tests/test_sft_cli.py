"""`cohort-grpo sft`: fine-tunes on prompt/completion or messages rows, saves a folder GRPO loads; the
built-in model's warm start goes through the same `sft_train`."""

import json

import pytest
import torch
from safetensors.torch import load_file

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.cli import main
from cohort_grpo.sft.sft_trainer import SFTConfig, encode_sft_row
from cohort_grpo.models.tiny import build_model, build_tokenizer

torch.set_num_threads(1)

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_sft")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _greedy(model_dir, prompt: str, new_tokens: int = 24) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_sft_learns_prompt_completion_rows_and_grpo_loads_the_result(tiny_dir, tmp_path, capsys):
    rows = [{"prompt": f"{a}+{a}=? ", "completion": f"<answer>{2 * a}</answer>"} for a in range(4)]
    out_dir = tmp_path / "sft"
    code = main(["sft", "--model", str(tiny_dir), "--data_files", _write_jsonl(tmp_path / "d.jsonl", rows),
                 "--output_dir", str(out_dir), "--max_steps", "60", "--learning_rate", "3e-3", "--batch_size", "8",
                 "--warmup_steps", "5", "--device", "cpu", "--logging_steps", "30"])
    assert code == 0
    assert "saved" in capsys.readouterr().out
    losses = json.loads((out_dir / "sft_losses.json").read_text())["losses"]
    assert len(losses) == 60 and sum(losses[-5:]) / 5 < 0.1 * sum(losses[:5]) / 5
    before, after = load_file(tiny_dir / "model.safetensors"), load_file(out_dir / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the model now writes the trained completions and stops (the EOS appended to each target is learnt)
    for row in rows:
        assert _greedy(out_dir, row["prompt"]) == row["completion"]
    # a GRPO run loads the folder with --model
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                      max_completion_length=4, max_steps=1, output_dir=str(tmp_path / "grpo"), quiet=True,
                      device="cpu", learning_rate=1e-4)
    trainer = GRPOTrainer(str(out_dir), lambda prompts, completions, **_: [1.0] * len(completions),
                          [{"prompt": r["prompt"]} for r in rows], args=args, log=lambda *_: None)
    trainer.train()
    assert len(trainer.history) == 1


def test_messages_rows_use_the_chat_template(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2=?"},
                {"role": "assistant", "content": "<answer>4</answer>"}]
    prompt, completion = encode_sft_row({"messages": messages}, tokenizer)
    expected_prompt = "system: be brief\nuser: 2+2=?\nassistant: "  # the template above, rendered by hand
    assert prompt == tokenizer(expected_prompt, add_special_tokens=False)["input_ids"]
    assert completion == tokenizer("<answer>4</answer>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # the same row as prompt/completion with a chat prompt encodes identically
    assert encode_sft_row({"prompt": messages[:-1], "completion": messages[-1]["content"]}, tokenizer) == (prompt, completion)
    # and from the CLI
    out_dir = tmp_path / "sft_chat"
    assert main(["sft", "--model", str(tiny_dir), "--data_files", _write_jsonl(tmp_path / "m.jsonl", [{"messages": messages}]),
                 "--output_dir", str(out_dir), "--max_steps", "2", "--device", "cpu"]) == 0
    assert (out_dir / "config.json").is_file() and (out_dir / "tokenizer.json").is_file()


@pytest.mark.parametrize("rows, fragment", [
    ([{"text": "hello"}], "need 'prompt' and 'completion' columns or 'messages'"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "ending with an assistant turn"),
])
def test_bad_rows_are_one_line_errors(tiny_dir, tmp_path, capsys, rows, fragment):
    assert main(["sft", "--model", str(tiny_dir), "--data_files", _write_jsonl(tmp_path / "bad.jsonl", rows),
                 "--output_dir", str(tmp_path / "o"), "--max_steps", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, fragment", [
    (["sft", "--data_files", "x.jsonl"], "needs --model"),
    (["sft", "--model", "m"], "exactly one of --data_files"),
    (["sft", "--model", "m", "--max_steps", "0", "--task", "arithmetic"], "--max_steps 0 must be at least 1"),
])
def test_bad_arguments(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_built_in_warm_start_goes_through_sft_train(tmp_path, monkeypatch):
    import cohort_grpo.sft.sft_trainer
    import cohort_grpo.models.tiny
    import cohort_grpo.sft.builtin

    calls = []

    def fake_sft_train(model, tokenizer, rows, config, log=print, should_stop=None, check_every=25):
        calls.append((rows, config))
        return [0.0]

    monkeypatch.setenv("COHORT_CACHE", str(tmp_path))
    monkeypatch.setattr(cohort_grpo.sft.sft_trainer, "sft_train", fake_sft_train)
    spec = dict(cohort_grpo.models.tiny.TINY_SPEC, version="test-sft-path", sft_steps=7)
    path = cohort_grpo.sft.builtin.tiny_model_dir(log=lambda *_: None, spec=spec)
    assert len(calls) == 1
    rows, config = calls[0]
    assert isinstance(config, SFTConfig) and config.max_steps == 7
    for r in rows[:50]:  # targets are the exact answers of the prompts' sums
        a, b = r["prompt"].split("=")[0].split("+")
        assert r["completion"] == f"<answer>{int(a) + int(b)}</answer>"
    assert (path / "config.json").is_file()
