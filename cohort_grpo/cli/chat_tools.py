"""`cohort-grpo chat` with tools: the model's tool calls are run and their results given back within the reply.

    cohort-grpo chat MODEL_DIR --tools mypkg.tools:calculator,run_python --max_tool_calling_iterations 5
    cohort-grpo chat MODEL_DIR --environment mypkg.envs:Counter     # an instance per conversation
    cohort-grpo chat runs/with-tools                                # the tools of its tools.json

The chat template renders the tools' JSON schemas (as in training) and the tool-call format is the
template's (`cohort_grpo.tools.family_of_template`: Hermes/Qwen `<tool_call>`, Llama 3 JSON). When a reply
holds calls, each is run (with a timeout) and shown as one line, `[calculator(expression='6*7') -> 42]`;
the assistant turn with its `tool_calls` and the tool messages join the conversation, and the model goes
on in the same reply, until it answers without a call or `max_tool_calling_iterations` rounds of calls
have run. A call that cannot be run (bad JSON, an unknown tool, a wrong argument, a tool that raises or
times out) is shown as a failure and its error text is what the model gets as the result. Each turn
runs only the tokens the KV cache does not hold (`ChatSession.generate`).

A training run with tools writes `tools.json` beside the model,
`{"tools": ["module:qualname", ...], "environment": "module:Class" or null, "max_tool_calling_iterations": N}`;
without --tools or --environment, chat uses it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cohort_grpo.errors import CohortError
from cohort_grpo.tools import (ToolCall, ToolCallError, ToolResult, assistant_message, environment_tools, family_of_template,
                     make_tools, resolve_environment, resolve_tools, run_tool_call, split_turn, tool_result_messages)
from cohort_grpo.tools.call_execution import DEFAULT_TIMEOUT_S
from cohort_grpo.tools.call_text import CLOSE_TAG, OPEN_TAG
from cohort_grpo.tools.toolbox import TOOLS_FILE, read_tools_file
from cohort_grpo.cli.chat import ChatSession, chat_loop, default_model_spec, load_for_inference, stderr_log
from cohort_grpo.cli.chat_flags import DEFAULT_MAX_ITERATIONS, chat_parser, parsed

SHOWN_CHARS = 300  # a tool line shows at most this much of the arguments, and of the result


@dataclass
class ChatTools:
    """What a chat with tools runs: tool functions, an environment class (an instance per conversation),
    the most rounds of calls per reply and the seconds one call may take."""

    functions: list[Callable[..., Any]] = field(default_factory=list)
    environment: type | None = None
    max_iterations: int = DEFAULT_MAX_ITERATIONS
    timeout_s: float = DEFAULT_TIMEOUT_S


def chat_tools_from_args(args: argparse.Namespace, model_spec: str | None,
                         log: Callable[[str], None]) -> ChatTools | None:
    """The tools the flags name, else those of MODEL_DIR/tools.json (said in one line to `log`), else None.
    Everything is imported and checked here, before the model loads."""
    if args.max_tool_calling_iterations is not None and args.max_tool_calling_iterations < 1:
        raise CohortError(f"--max_tool_calling_iterations={args.max_tool_calling_iterations}: it must be at least 1")
    if not args.tool_timeout > 0:
        raise CohortError(f"--tool_timeout={args.tool_timeout}: it must be more than 0 seconds")
    chosen = args.tools is not None and args.tools.strip().lower() != "none"
    if args.tools is not None and not chosen:  # --tools none: no tools, whatever the model folder holds
        if args.environment:
            raise CohortError("--tools none with --environment: the environment's methods are tools; drop one of them")
        return None
    if chosen or args.environment:
        if args.raw:
            raise CohortError("--raw has no chat template to give the model its tools; drop --raw or the tools")
        tools = ChatTools(functions=resolve_tools(args.tools) if chosen else [],
                          environment=resolve_environment(args.environment) if args.environment else None,
                          max_iterations=args.max_tool_calling_iterations or DEFAULT_MAX_ITERATIONS,
                          timeout_s=args.tool_timeout)
        named = [t.strip() for t in args.tools.split(",") if t.strip()] if chosen else []
        log(f"cohort: tools: {loaded_names(named, args.environment)}; {rounds_text(tools.max_iterations)}")
        return tools
    path = Path(model_spec) / TOOLS_FILE if model_spec else None
    if args.raw or path is None or not path.is_file():
        return None
    try:
        settings = read_tools_file(path)
    except CohortError as e:
        raise CohortError(f"{e}; or chat without it: --tools none") from None
    try:
        functions = resolve_tools(settings["tools"])
        environment = resolve_environment(settings["environment"]) if settings["environment"] else None
    except CohortError as e:
        raise CohortError(f"{path}: {e}; or chat without its tools: --tools none") from None
    iterations = args.max_tool_calling_iterations or settings["max_tool_calling_iterations"] or DEFAULT_MAX_ITERATIONS
    if not functions and environment is None:  # training had tools it could not record by name
        log(f"cohort: {path} names no tools (training could not save them by import name; its log said why): "
            "chatting without tools; pass --tools module:function to give the model its tools")
        return None
    log(f"cohort: tools: {loaded_names(settings['tools'], settings['environment'])}, the ones the model was trained "
        f"with ({path}); {rounds_text(iterations)} (--tools none to chat without them)")
    return ChatTools(functions=functions, environment=environment, max_iterations=iterations,
                     timeout_s=args.tool_timeout)


def loaded_names(tools: list[str], environment: str | None) -> str:
    return ", ".join(tools + ([f"environment {environment}"] if environment else [])) or "none"


def rounds_text(iterations: int) -> str:
    return f"at most {iterations} round{'s' if iterations != 1 else ''} of tool calls per reply"


# ---- what the user sees ------------------------------------------------------------------------------
def _clip(text: str) -> str:
    text = text.strip().replace("\r", "").replace("\n", "\\n")  # one line, whatever the tool printed
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def call_line(call, result: ToolResult | None, note: str | None = None) -> str:
    """A call as the user sees it: `[calculator(expression='6*7') -> 42]`, `[calculator(...) failed: why]`,
    or `[calculator(...) note]` for a call that was not run."""
    if isinstance(call, ToolCallError):
        return f"[{call.name or 'tool call'} failed: {_clip(call.message)}]"
    shown = f"{call.name}({_clip(', '.join(f'{k}={v!r}' for k, v in call.arguments.items()))})"
    if result is None:
        return f"[{shown} {note}]"
    if not result.failed:
        return f"[{shown} -> {_clip(result.text)}]"
    try:  # the model gets TRL's `str({"error": message})`; the user reads the message
        message = ast.literal_eval(result.text)["error"]
    except (ValueError, SyntaxError, KeyError, TypeError):
        message = result.text
    return f"[{shown} failed: {_clip(str(message))}]"


def visible_text(text: str, family: str) -> str:
    """The part of a growing turn's text that can be shown now: without its tool calls (each is shown as
    a line once run) and without what may be the start of one. Stripped: the calls' lines separate pieces."""
    if family == "hermes":
        pieces, position = [], 0
        while True:
            open_at = text.find(OPEN_TAG, position)
            if open_at < 0:
                tail = text[position:]
                held = max((k for k in range(1, len(OPEN_TAG)) if tail.endswith(OPEN_TAG[:k])), default=0)
                pieces.append(tail[: len(tail) - held])
                break
            pieces.append(text[position:open_at])
            close_at = text.find(CLOSE_TAG, open_at)
            if close_at < 0:  # inside a call (or a cut-off one): nothing more to show
                break
            position = close_at + len(CLOSE_TAG)
        return "".join(pieces).strip()
    # llama3: a message that starts with "{" may be a call (all of the message): shown at its end if it is not
    return "" if text.lstrip().startswith("{") else text.strip()


class ReplyDisplay:
    """Streams a reply to `on_text`: the model's text without its tool calls, and a line per call."""

    def __init__(self, family: str, on_text: Callable[[str], None]):
        self.family, self.on_text = family, on_text
        self.last = ""  # the last character shown, to start each call's line on a line of its own
        self.text, self.shown = "", ""

    def start_turn(self) -> None:
        self.text, self.shown = "", ""

    def push(self, piece: str) -> None:
        self.text += piece
        self._show(visible_text(self.text, self.family))

    def end_turn(self, calls: list) -> None:
        """The rest of the turn's text: all of it when it made no call, else what lies outside its calls."""
        self._show(text_outside(self.text, calls) if calls else self.text.strip())

    def line(self, text: str) -> None:
        self._write(("\n" if self.last and self.last != "\n" else "") + text + "\n")

    def _show(self, visible: str) -> None:
        if visible.startswith(self.shown) and len(visible) > len(self.shown):
            self._write(visible[len(self.shown):])
            self.shown = visible

    def _write(self, piece: str) -> None:
        self.on_text(piece)
        self.last = piece[-1]


def text_outside(text: str, calls: list) -> str:
    """`text` with the spans of `calls` (ToolCalls, ToolCallErrors) cut out, stripped."""
    pieces, position = [], 0
    for call in sorted(calls, key=lambda c: c.start):
        pieces.append(text[position:call.start])
        position = max(position, call.end)
    pieces.append(text[position:])
    return "".join(pieces).strip()


# ---- the session ---------------------------------------------------------------------------------------
class ToolChatSession(ChatSession):
    """A `ChatSession` whose replies may call tools (see the module's docstring)."""

    def __init__(self, model, tokenizer, tools: ChatTools, **options):
        super().__init__(model, tokenizer, **options)
        if self.raw:
            raise CohortError("--raw has no chat template to give the model its tools; drop --raw or the tools")
        self.family = family_of_template(getattr(tokenizer, "chat_template", None))
        if self.family is None:
            raise CohortError("the model's chat template renders no tool-call format cohort reads (Hermes/Qwen "
                              "<tool_call>, Llama 3 JSON); chat without tools: --tools none")
        self.settings = tools
        self.start_conversation()

    def start_conversation(self) -> None:
        """A fresh environment (its reset() text is kept for the first user message) and the tool table."""
        functions: list = list(self.settings.functions)
        self.observation: str | None = None
        if self.settings.environment is not None:
            name = getattr(self.settings.environment, "__qualname__", repr(self.settings.environment))
            try:
                environment = self.settings.environment()
                observation = environment.reset()
            except Exception as e:  # the user's class: say which step failed, in one line
                raise CohortError(f"environment {name}: creating it and calling reset() failed ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())}); chat calls reset() with no arguments") from e
            if observation is not None and not isinstance(observation, str):
                raise CohortError(f"environment {name}: reset() returned a {type(observation).__name__}; it must "
                                  "return the text to append to the first user message, or None")
            self.observation = observation
            functions += environment_tools(environment)
        self.tools = make_tools(functions)
        self.tool_schemas = [tool.schema for tool in self.tools.values()]

    def reset(self) -> None:
        super().reset()
        self.start_conversation()

    def reply(self, user_text: str, on_text: Callable[[str], None] = lambda piece: None) -> str:
        """Stream the answer, running the model's tool calls on the way; returns the last turn's text."""
        if self.observation:  # TRL: reset()'s text is appended to the conversation's first user message
            user_text += self.observation
            self.notice(f"(the environment's reset() text was appended to this message: {_clip(self.observation)})")
            self.observation = None
        display, turns, answer = ReplyDisplay(self.family, on_text), [], ""
        for rounds_run in range(self.settings.max_iterations + 1):
            try:
                prompt, _ = self.prompt_for(user_text, turns)  # images are refused with tools
            except CohortError:
                if not turns:
                    raise
                self.notice("(the tool results outgrew the model's context: the reply ends here)")
                break
            display.start_turn()
            text = self.generate(prompt, display.push).text()
            turn = split_turn(text, self.family, self.tools)
            display.end_turn(turn.calls)
            answer = text.strip()
            if not turn.calls or rounds_run == self.settings.max_iterations:
                for call in turn.calls:  # the limit was reached: these are not run
                    display.line(call_line(call, None, f"not run: --max_tool_calling_iterations "
                                                       f"{self.settings.max_iterations} reached"))
                turns.append({"role": "assistant", "content": answer})
                break
            # beside its tool_calls, the assistant message keeps a call that cannot run as it was written, so
            # the model sees what it wrote next to the error it gets back
            runnable = [call for call in turn.calls if isinstance(call, ToolCall)]
            turns.append(assistant_message(runnable, text_outside(text, runnable)))
            for call in turn.calls:
                result = run_tool_call(call, self.tools, self.settings.timeout_s)
                display.line(call_line(call, result))
                turns += tool_result_messages(call, result)
            answer = ""
        self.history += [{"role": "user", "content": user_text}, *turns]
        return answer


def chat_session(model, tokenizer, tools: ChatTools | None, **options) -> ChatSession:
    """A `ToolChatSession` when there are tools, else a plain `ChatSession`."""
    return ToolChatSession(model, tokenizer, tools, **options) if tools else ChatSession(model, tokenizer, **options)


def chat_main(argv: list[str]) -> int:
    """`cohort-grpo chat [MODEL_DIR] [options]`; reads stdin, so it works from a pipe too."""
    args = parsed(chat_parser(), argv)
    spec = args.model if args.model is not None else default_model_spec(stderr_log)
    tools = chat_tools_from_args(args, spec, stderr_log)  # before the model loads: a bad name fails at once
    for path in args.image:  # before the model loads too: a mistyped path fails at once
        if not Path(path).expanduser().is_file():
            raise CohortError(f"--image {path}: no such file; give the path of an image file (PNG, JPEG, ...)")
    model, tokenizer, _ = load_for_inference(spec, args.device, args.dtype, log=stderr_log, impl=args.model_impl)
    session = chat_session(model, tokenizer, tools, model_spec=spec, system=args.system, raw=args.raw,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, notice=stderr_log)
    for path in args.image:  # the first message's images
        session.attach_image(path, "--image")
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    return chat_loop(session, sys.stdin, sys.stdout, sys.stderr, interactive)
