"""Tools by name (`cohort_grpo.tools.resolve_tools`, `resolve_environment`, `tool_spec`) and `cohort-grpo chat` with
tools: a call in the reply is run, shown as one line, given back as the template's tool turn, and the model
goes on in the same reply; a malformed call gives the model its error; a model folder's tools.json is used.

The model is a real (random, one-layer) cohort model with a character tokenizer and a Qwen-style template,
so the KV cache, the rendering and the decoding are the real ones; only the token choice is scripted
(`ChatSession.sample` returns the next token of the reply the test wrote)."""

import io
import json
import sys
import textwrap

import pytest
import torch

from cohort_grpo.cli.chat import ChatSession
from cohort_grpo.cli.chat_tools import ChatTools, ToolChatSession, chat_main, visible_text
from cohort_grpo.errors import CohortError, command_line
from cohort_grpo.models import from_pretrained
from cohort_grpo.tools import ToolCall, format_tool_calls, resolve_environment, resolve_tools, run_python, tool_spec
from helpers import QWEN_STYLE_TEMPLATE

MODULE = "cohort_chat_tools_testmod"  # written into a temporary folder on sys.path by the `tools_module` fixture
MODULE_SOURCE = textwrap.dedent('''
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. 347*2891.
        """
        return str(eval(expression, {"__builtins__": {}}))


    def no_docstring(x: int) -> int:
        return x


    def no_hints(x):
        """Return x.

        Args:
            x: A value.
        """
        return x


    def flood(size: int) -> str:
        """Return a long text.

        Args:
            size: Its length in characters.
        """
        return "x" * size


    NOT_A_FUNCTION = 3


    class Counter:
        """An environment: a counter the model increments."""

        def __init__(self):
            self.count = 0

        def reset(self, **kwargs):
            self.count = 0
            return " (the counter is at 0)"

        def increment(self, step: int) -> int:
            """Add to the counter and return its value.

            Args:
                step: How much to add.
            """
            self.count += step
            return self.count


    class NoReset:
        pass
''')



def build_chat_tokenizer(template: str | None = QWEN_STYLE_TEMPLATE):
    """One token per printable ASCII character and newline, and <|im_start|>/<|im_end|> (the EOS) as
    special tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1}
    for char in [chr(code) for code in range(32, 127)] + ["\n"]:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token a character
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>")
    tokenizer.chat_template = template
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def scripted_sampler(tokenizer, replies: list[str]):
    """A `sample(logits)` that writes `replies` in order, each ended by the EOS, whatever the logits say."""
    queue = [token for reply in replies for token in encode(tokenizer, reply) + [tokenizer.eos_token_id]]
    return lambda *args: queue.pop(0)


def hermes_call(name: str, **arguments) -> str:
    return format_tool_calls([ToolCall(name, arguments)], "hermes")


@pytest.fixture(scope="module")
def tools_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools_module")
    (folder / f"{MODULE}.py").write_text(MODULE_SOURCE)
    (folder / "cohort_chat_tools_broken.py").write_text("raise RuntimeError('broken on import\\nsecond line')\n")
    sys.path.insert(0, str(folder))
    yield __import__(MODULE)
    sys.path.remove(str(folder))
    sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tools_module):
    """A one-layer random Llama for the character tokenizer, saved with a tools.json naming the calculator."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("chat_tools_model")
    tokenizer = build_chat_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "tools.json").write_text(json.dumps({"tools": [f"{MODULE}:calculator"], "environment": None,
                                                   "max_tool_calling_iterations": 2}))
    return folder


@pytest.fixture(scope="module")
def model(model_dir):
    torch.set_num_threads(1)
    return from_pretrained(str(model_dir)).eval()


def session_with(model, tools: ChatTools, replies: list[str], **options) -> ToolChatSession:
    tokenizer = build_chat_tokenizer()
    session = ToolChatSession(model, tokenizer, tools, max_new_tokens=400, temperature=0.0,
                              notice=options.pop("notice", lambda message: None), **options)
    session.sample = scripted_sampler(tokenizer, replies)
    return session


# ---- loading tools and environments by name ----------------------------------------------------------
def test_resolve_tools_from_a_string_or_a_list(tools_module):
    calculator = tools_module.calculator
    assert resolve_tools(f"{MODULE}:calculator, run_python,") == [calculator, run_python]
    assert resolve_tools([f" {MODULE}:calculator", calculator]) == [calculator, calculator]
    assert resolve_tools(None) == [] and resolve_tools("") == []
    assert resolve_environment(f"{MODULE}:Counter") is tools_module.Counter
    assert resolve_environment(tools_module.Counter) is tools_module.Counter


@pytest.mark.parametrize("spec, message", [
    ("calculator", r"tool 'calculator' is not 'module:name'; write it as e\.g\. 'mypackage\.tools:calculator'"),
    ("cohort_chat_tools_nowhere:f", r"tool 'cohort_chat_tools_nowhere:f': cannot import module "
                                    r"'cohort_chat_tools_nowhere' \(ModuleNotFoundError: .*PYTHONPATH"),
    ("cohort_chat_tools_broken:f", r"cannot import module 'cohort_chat_tools_broken' \(RuntimeError: broken on "
                                   r"import second line\)"),
    (f"{MODULE}:missing", rf"tool '{MODULE}:missing': module '{MODULE}' has no attribute 'missing'"),
    (f"{MODULE}:NOT_A_FUNCTION", rf"tool '{MODULE}:NOT_A_FUNCTION' is a int, not a function"),
    (f"{MODULE}:no_docstring", rf"tool '{MODULE}:no_docstring': has no docstring; write a Google-style one"),
    (f"{MODULE}:no_hints", rf"tool '{MODULE}:no_hints': argument 'x' has no type hint; annotate it"),
])
def test_each_bad_tool_spec_is_a_one_line_error_naming_it(tools_module, spec, message):
    with pytest.raises(CohortError, match=message) as error:
        resolve_tools(f"run_python,{spec}")
    assert "\n" not in str(error.value)


def test_bad_environment_specs(tools_module):
    with pytest.raises(CohortError, match=rf"environment '{MODULE}:NoReset' has no callable reset; define reset"):
        resolve_environment(f"{MODULE}:NoReset")
    with pytest.raises(CohortError, match=rf"environment '{MODULE}:NOT_A_FUNCTION' is a int, not a class"):
        resolve_environment(f"{MODULE}:NOT_A_FUNCTION")
    with pytest.raises(CohortError, match=r"environment 'Counter' is not 'module:name'"):
        resolve_environment("Counter")


def test_tool_spec_names_what_can_be_imported_again(tools_module):
    def nested(x: int) -> int:
        """Nested.

        Args:
            x: A value.
        """
        return x

    assert tool_spec(tools_module.calculator) == f"{MODULE}:calculator"
    assert tool_spec(tools_module.Counter) == f"{MODULE}:Counter"
    assert tool_spec(run_python) == "run_python"
    assert tool_spec(nested) is None and tool_spec(lambda x: x) is None and tool_spec(tools_module.Counter()) is None
    assert tool_spec(tools_module.Counter().increment) is None  # a bound method: another instance on import
    specs = [tool_spec(tools_module.calculator), tool_spec(run_python)]
    assert resolve_tools(specs) == [tools_module.calculator, run_python]  # the round trip a run's tools.json makes


# ---- chat with tools -------------------------------------------------------------------------------------------
def test_a_call_is_run_given_back_as_a_tool_turn_and_the_reply_goes_on_from_the_cache(model, tools_module):
    session = session_with(model, ChatTools(resolve_tools(f"{MODULE}:calculator")),
                           [hermes_call("calculator", expression="347*2891"), "It is 1003177."])
    tokenizer = session.tokenizer
    fed = []
    extend = session.decoder.extend
    session.decoder.extend = lambda ids: fed.append(len(ids)) or extend(ids)
    pieces = []
    answer = session.reply("What is 347*2891?", pieces.append)

    assert answer == "It is 1003177."
    assert "".join(pieces) == "[calculator(expression='347*2891') -> 1003177]\nIt is 1003177."  # no raw call shown
    assert session.history == [
        {"role": "user", "content": "What is 347*2891?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347*2891"}}}]},
        {"role": "tool", "name": "calculator", "content": "1003177"},
        {"role": "assistant", "content": "It is 1003177."}]
    context = tokenizer.decode(session.decoder.tokens, skip_special_tokens=False)
    assert '"name": "calculator"' in context.split("<tools>")[1].split("</tools>")[0]  # the template shows the tool
    assert context.endswith('</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n1003177\n</tool_response>'
                            '<|im_end|>\n<|im_start|>assistant\nIt is 1003177.')
    # the second turn's prompt ran only what follows the call: the rendered call is the generated one
    prefills = [n for n in fed if n > 1]
    assert prefills[1] == len(encode(tokenizer, "<|im_end|>\n<|im_start|>user\n<tool_response>\n1003177\n"
                                                "</tool_response><|im_end|>\n<|im_start|>assistant\n"))
    assert len(prefills) == 2  # one prompt per turn; every generated token is one single-token forward

    # the next message reuses the whole exchange from the cache
    session.sample = scripted_sampler(tokenizer, ["Yes."])
    fed.clear()
    assert session.reply("Sure?", pieces.append) == "Yes."
    assert fed[0] == len(encode(tokenizer, "<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"))


def test_a_malformed_call_gives_the_model_its_error_and_the_reply_goes_on(model, tools_module):
    bad_json = '<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>'
    turn = "Trying.\n" + "\n".join([bad_json, hermes_call("calculator", expression="1/0"),
                                     hermes_call("power", a=2)])
    session = session_with(model, ChatTools(resolve_tools(f"{MODULE}:calculator")), [turn, "Sorry."])
    pieces = []
    assert session.reply("Break it.", pieces.append) == "Sorry."
    shown = "".join(pieces).splitlines()
    assert shown[0] == "Trying."
    assert shown[1] == "[calculator failed: the tool call is not valid JSON (Expecting value at character 51)]"
    assert shown[2] == "[calculator(expression='1/0') failed: ZeroDivisionError: division by zero]"
    assert shown[3] == "[power failed: unknown tool 'power'; the tools are: calculator]"
    assert shown[4] == "Sorry."
    results = [m for m in session.history if m["role"] == "tool"]
    assert results[0] == {"role": "tool", "name": "calculator",
                          "content": "{'error': 'the tool call is not valid JSON (Expecting value at character 51)'}"}
    assert results[1] == {"role": "tool", "name": "calculator",
                          "content": "{'error': 'ZeroDivisionError: division by zero'}"}
    assert results[2]["content"] == "{'error': \"unknown tool 'power'; the tools are: calculator\"}"
    call_turn = session.history[1]
    assert [c["function"]["name"] for c in call_turn["tool_calls"]] == ["calculator"]  # the runnable call
    # what cannot run stays as written in the assistant turn, so the model sees it beside its error
    assert bad_json in call_turn["content"] and '"name": "power"' in call_turn["content"]
    context = session.tokenizer.decode(session.decoder.tokens, skip_special_tokens=False)
    assert "<tool_response>\n{'error': 'ZeroDivisionError: division by zero'}\n</tool_response>" in context


def test_the_iteration_limit_ends_the_reply_without_running_more_calls(model, tools_module):
    call = hermes_call("calculator", expression="1+1")
    session = session_with(model, ChatTools(resolve_tools(f"{MODULE}:calculator"), max_iterations=1),
                           [call, "again " + call])
    pieces = []
    session.reply("Loop.", pieces.append)
    assert "".join(pieces) == ("[calculator(expression='1+1') -> 2]\nagain\n"
                               "[calculator(expression='1+1') not run: --max_tool_calling_iterations 1 reached]\n")
    assert [m["role"] for m in session.history] == ["user", "assistant", "tool", "assistant"]
    assert session.history[-1]["content"] == "again " + call


def test_an_environment_per_conversation_its_reset_text_and_its_methods_as_tools(model, tools_module):
    notices = []
    increment = hermes_call("increment", step=2)
    session = session_with(model, ChatTools(environment=resolve_environment(f"{MODULE}:Counter")),
                           [increment, "Done.", increment, "Done."], notice=notices.append)
    pieces = []
    session.reply("Add two.", pieces.append)
    session.reply("Add two more.", pieces.append)
    assert session.history[0]["content"] == "Add two. (the counter is at 0)"  # reset()'s text, first message only
    assert session.history[4]["content"] == "Add two more."
    assert "appended" in notices[0]
    assert [m["content"] for m in session.history if m["role"] == "tool"] == ["2", "4"]  # one instance per conversation
    session.reset()  # a new conversation: a new environment
    session.sample = scripted_sampler(session.tokenizer, [increment, "Done."])
    session.reply("Add two.", pieces.append)
    assert [m["content"] for m in session.history if m["role"] == "tool"] == ["2"]
    assert session.history[0]["content"] == "Add two. (the counter is at 0)"


def test_tool_results_past_the_context_end_the_reply_and_the_next_message_starts_afresh(model, tools_module):
    notices = []
    session = session_with(model, ChatTools(resolve_tools(f"{MODULE}:flood")),
                           [hermes_call("flood", size=3000), "Hello."], notice=notices.append)
    pieces = []
    assert session.reply("Flood it.", pieces.append) == ""
    assert notices == ["(the tool results outgrew the model's context: the reply ends here)"]
    assert "".join(pieces).startswith("[flood(size=3000) -> xxx") and len(pieces[-1]) < 400  # one short line
    assert session.reply("Hi.", pieces.append) == "Hello."  # the flooded exchange is dropped to make room
    assert "dropped the oldest exchange" in notices[1]
    assert [m["content"] for m in session.history] == ["Hi.", "Hello."]


# A template in the Llama 3 JSON layout: a call is the whole assistant message.
LLAMA_STYLE_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.tool_calls is defined and message.tool_calls %}{%- set f = message.tool_calls[0].function %}"
    "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' + (f.arguments | tojson) + '}' }}"
    "{%- else %}{{- message.content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_llama3_json_calls_are_run_too(model, tools_module):
    tokenizer = build_chat_tokenizer(LLAMA_STYLE_TEMPLATE)
    session = ToolChatSession(model, tokenizer, ChatTools(resolve_tools(f"{MODULE}:calculator")), max_new_tokens=400,
                              temperature=0.0, notice=lambda message: None)
    call = format_tool_calls([ToolCall("calculator", {"expression": "6*7"})], "llama3")
    session.sample = scripted_sampler(tokenizer, [call, "42 it is.", '{"answer": 42}'])
    pieces = []
    assert session.family == "llama3" and session.reply("6*7?", pieces.append) == "42 it is."
    assert "".join(pieces) == "[calculator(expression='6*7') -> 42]\n42 it is."
    context = tokenizer.decode(session.decoder.tokens, skip_special_tokens=False)
    assert context.endswith(call + "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n42 it is.")
    pieces.clear()
    assert session.reply("As JSON?", pieces.append) == '{"answer": 42}'  # JSON that is not a call is the answer
    assert "".join(pieces) == '{"answer": 42}'


def test_a_template_without_a_tool_call_format_is_refused(model, tools_module):
    plain = build_chat_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with command_line(), pytest.raises(CohortError, match="renders no tool-call format.*--tools none"):
        ToolChatSession(model, plain, ChatTools(resolve_tools("run_python")))


def test_calls_are_held_back_from_the_stream_until_they_are_run():
    assert visible_text("Let me compute.\n<tool_c", "hermes") == "Let me compute."
    assert visible_text('Sure <tool_call>\n{"name": "f"', "hermes") == "Sure"
    assert visible_text('A<tool_call>{}</tool_call> B <tool', "hermes") == "A B"
    assert visible_text("a <tool_cx", "hermes") == "a <tool_cx"
    assert visible_text(' {"name": "f", "param', "llama3") == ""
    assert visible_text("The answer", "llama3") == "The answer"


# ---- the command line --------------------------------------------------------------------------------------------
def run_chat(monkeypatch, capsys, argv: list[str], text: str, replies: list[str]) -> tuple[str, str]:
    tokenizer = build_chat_tokenizer()
    monkeypatch.setattr(ChatSession, "sample", scripted_sampler(tokenizer, replies))
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert chat_main(argv) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.slow
def test_chat_uses_the_tools_json_of_the_model_folder(model_dir, tools_module, monkeypatch, capsys):
    replies = [hermes_call("calculator", expression="6*7"), "It is 42."]
    out, err = run_chat(monkeypatch, capsys, [str(model_dir), "--temperature", "0", "--device", "cpu"],
                        "What is 6*7?\n", replies)
    assert out == "[calculator(expression='6*7') -> 42]\nIt is 42.\n"
    notes = [line for line in err.splitlines() if "tools.json" in line]
    assert len(notes) == 1 and f"{MODULE}:calculator" in notes[0] and "at most 2 rounds" in notes[0]

    # --tools none: a plain chat, the call is only text
    out, err = run_chat(monkeypatch, capsys, [str(model_dir), "--tools", "none", "--temperature", "0"],
                        "What is 6*7?\n", replies[:1])
    assert out == replies[0] + "\n" and "tools.json" not in err

    # --tools replaces tools.json's; --max_tool_calling_iterations its limit
    out, err = run_chat(monkeypatch, capsys, [str(model_dir), "--tools", "run_python", "--temperature", "0",
                                              "--max_tool_calling_iterations", "1"],
                        "Run it.\n", [hermes_call("run_python", code="print(6 * 7)"), "Printed."])
    assert out == "[run_python(code='print(6 * 7)') -> 42]\nPrinted.\n" and "tools.json" not in err
    assert "cohort: tools: run_python; at most 1 round of tool calls per reply" in err.splitlines()


def test_chat_says_when_the_tools_json_names_no_tools(model_dir, tmp_path, monkeypatch, capsys):
    """A run whose tools could not be recorded by name left `"tools": []`: chat says so instead of nothing."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "tools.json").write_text(json.dumps({"tools": [], "environment": None, "max_tool_calling_iterations": 2}))
    replies = [hermes_call("calculator", expression="6*7")]
    out, err = run_chat(monkeypatch, capsys, [str(folder), "--temperature", "0"], "What is 6*7?\n", replies)
    assert out == replies[0] + "\n"  # no tools: the call is only text
    assert "names no tools" in err and "pass --tools module:function" in err


def test_bad_tool_flags_and_files_fail_before_the_model_loads(model_dir, tools_module, tmp_path, monkeypatch):
    import cohort_grpo.cli.chat as chat

    monkeypatch.setattr(chat, "load_for_inference", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(CohortError, match="tool 'cohort_chat_tools_nowhere:f': cannot import module"):
        chat_main([str(model_dir), "--tools", "cohort_chat_tools_nowhere:f"])
    with command_line(), pytest.raises(CohortError, match="--max_tool_calling_iterations=0: it must be at least 1"):
        chat_main([str(model_dir), "--max_tool_calling_iterations", "0"])
    with command_line(), pytest.raises(CohortError, match="--raw has no chat template"):
        chat_main([str(model_dir), "--raw", "--tools", "run_python"])
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tools.json").write_text(json.dumps({"tools": [f"{MODULE}:missing"], "environment": None}))
    with command_line(), pytest.raises(CohortError, match=rf"tools\.json: tool '{MODULE}:missing': .* --tools none"):
        chat_main([str(folder)])
    (folder / "tools.json").write_text('{"tools": "calculator"}')
    with pytest.raises(CohortError, match=r"tools\.json is not \{\"tools\""):
        chat_main([str(folder)])
