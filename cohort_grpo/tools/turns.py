"""`ToolTurns`: the rollout's tool turns. When a sequence ends a turn, its text is parsed for tool calls
(the family its chat template writes); the calls run off the sampling thread, concurrently, each with a
timeout; their results become the chat template's tool turn, tokenised on their own and appended to the
sequence (cohort_grpo/rollout/turns.py says how the engine continues it).

The tool turn's text is what the template renders after the assistant turn that made the calls: render
[user, assistant(calls)] and [user, assistant(calls), tool results] with the generation prompt, and take
the difference (plus whatever the template writes after the model's end-of-turn token, such as Qwen's
newline after <|im_end|>). Only that new text is tokenised; the model's own tokens are never re-encoded.

One `ToolTurns` serves one rollout call: it keeps, per completion, the calls it ran, their results and
timings, which make the step's `tools/*` metrics and the completion's conversation (what reward
functions and completions.jsonl see).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from cohort_grpo.errors import CohortError
from cohort_grpo.tools.call_execution import DEFAULT_TIMEOUT_S, execute_tool_call
from cohort_grpo.tools.call_messages import assistant_message, tool_result_messages
from cohort_grpo.tools.call_text import family_name, family_of_template, split_turn
from cohort_grpo.tools.schema import environment_tools, make_tools

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def tool_loop() -> asyncio.AbstractEventLoop:
    """The event loop, on a daemon thread of its own, that runs every rollout's tool calls."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="cohort-tool-loop", daemon=True).start()
            _loop = loop
    return _loop


@dataclass
class CompletionTools:
    """What one completion's tool turns did."""

    iterations: int = 0  # turns that made calls (each followed by a tool turn)
    calls: int = 0
    failures: int = 0
    seconds: float = 0.0  # summed over its calls
    tool_messages: list[list[dict]] = field(default_factory=list)  # one list per tool turn


class ToolTurns:
    """A `cohort_grpo.rollout.turns.TurnHandler` that runs tool calls.

    tools: the rollout's tool functions (typed, documented; sync or async).
    environments: one object per completion (row order) whose public methods are tools too, or None.
    max_iterations: most tool turns per completion (None: no limit but the completion budget).
    template_kwargs: the run's chat_template_kwargs, rendered into the tool turns as into the prompt.
    """

    def __init__(self, tokenizer, tools=(), *, environments: list | None = None, max_iterations: int | None = None,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, family: str | None = None, num_rows: int = 0,
                 template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        template = getattr(tokenizer, "chat_template", None)
        family = family or family_of_template(template)
        if family is None:
            raise CohortError("the tokenizer's chat template renders no tool calls (no <tool_call> or Llama 3 JSON "
                              "format); use a tool-calling model (Qwen2.5/3, Llama 3.1+) or set a chat template that does")
        self.family = family_name(family)
        self.max_iterations = max_iterations
        self.timeout_s = timeout_s
        self.environments = environments
        self.shared = make_tools(list(tools))
        self.tables: dict[int, dict] = {}
        self.records = [CompletionTools() for _ in range(num_rows)]
        eos = tokenizer.eos_token
        self.eos_text = eos if isinstance(eos, str) and eos else None

    # ---- the handler --------------------------------------------------------------------------------------
    def end_of_turn(self, index: int, completion: list[int], turn_start: int):
        record = self.record(index)
        if self.max_iterations is not None and record.iterations >= self.max_iterations:
            return None
        table = self.table(index)
        calls = split_turn(self.turn_text(completion[turn_start:]), self.family, table).calls
        if not calls:
            return None
        record.iterations += 1
        record.calls += len(calls)
        return asyncio.run_coroutine_threadsafe(self.run_calls(record, calls, table), tool_loop())

    def close(self) -> None:
        pass

    async def run_calls(self, record: CompletionTools, calls: list, table: dict) -> list[int]:
        """Run a turn's calls concurrently; the tool turn's tokens."""
        results = await asyncio.gather(*(execute_tool_call(call, table, self.timeout_s) for call in calls))
        record.failures += sum(result.failed for result in results)
        record.seconds += sum(result.seconds for result in results)
        messages = [m for call, result in zip(calls, results) for m in tool_result_messages(call, result)]
        record.tool_messages.append(messages)
        text = self.tool_turn_text(calls, messages, table)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ---- rendering ----------------------------------------------------------------------------------------
    def turn_text(self, ids: list[int]) -> str:
        """A turn's text as the model wrote it (special tokens kept: a family's call tags may be special)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self.eos_text and text.endswith(self.eos_text):
            text = text[: -len(self.eos_text)]
        return text

    def tool_turn_text(self, calls: list, messages: list[dict], table: dict) -> str:
        """The text the template writes after the model's end of turn: the tool turn and the next
        assistant turn's opening."""
        schemas = [tool.schema for tool in table.values()] or None
        conversation = [{"role": "user", "content": "?"}, assistant_message(calls)]
        return appended_text(self.tokenizer.apply_chat_template, conversation, messages, self.eos_text,
                             "a tool turn", "use a template with a 'tool' role", tools=schemas,
                             **self.template_kwargs)

    # ---- per completion -----------------------------------------------------------------------------------
    def record(self, index: int) -> CompletionTools:
        while len(self.records) <= index:
            self.records.append(CompletionTools())
        return self.records[index]

    def table(self, index: int) -> dict:
        """The tools completion `index` may call: the shared ones and its environment's methods."""
        if self.environments is None:
            return self.shared
        if index not in self.tables:
            self.tables[index] = {**self.shared, **make_tools(environment_tools(self.environments[index]))}
        return self.tables[index]

    def conversation(self, index: int, ids: list[int], sampled: list[int]) -> list[dict]:
        """Completion `index` as chat messages (TRL's form): an assistant message per turn the model
        wrote (its text, and `tool_calls` when it called), the tool messages after each call."""
        messages, segment, tool_turn = [], [], 0
        record = self.record(index)
        for position, (token, mine) in enumerate(zip(ids, sampled)):
            if mine:
                segment.append(token)
            if segment and (not mine or position == len(ids) - 1):
                turn = split_turn(self.turn_text(segment), self.family, self.table(index))
                messages.append(assistant_message(turn.calls, turn.content))
                segment = []
            if not mine and (position == 0 or sampled[position - 1]):  # a tool turn starts here
                if tool_turn < len(record.tool_messages):
                    messages.extend(record.tool_messages[tool_turn])
                tool_turn += 1
        return messages

    def metrics(self, num_completions: int) -> dict[str, float]:
        """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed / calls),
        and the mean tool turns per completion and seconds per call."""
        records = self.records[:num_completions] or [CompletionTools()]
        calls = sum(r.calls for r in records)
        return {"tools/call_frequency": calls / max(num_completions, 1),
                "tools/failure_frequency": sum(r.failures for r in records) / calls if calls else 0.0,
                "tools/turns": sum(r.iterations for r in records) / max(num_completions, 1),
                "tools/seconds_per_call": sum(r.seconds for r in records) / calls if calls else 0.0}


def appended_text(render, conversation: list[dict], messages: list[dict], eos_text: str | None, turn: str,
                  fix: str, **template_options) -> str:
    """The text a chat template (`render`: apply_chat_template) writes after the model's last turn when `messages`
    follow it: those messages and the next assistant turn's opening, after what follows the model's end-of-turn
    token (Qwen: a newline). A template that cannot render `turn` (a tool turn, an environment's turn) is refused
    with `fix`; one that rewrites earlier turns too, since the model's own tokens must be kept as sampled."""
    try:
        before = render(conversation, tokenize=False, **template_options)
        after = render(conversation + messages, tokenize=False, add_generation_prompt=True, **template_options)
    except Exception as e:  # noqa: BLE001 - a template error is the user's to fix, said in one line
        raise CohortError(f"the chat template cannot render {turn} ({type(e).__name__}: {e}); {fix}") from e
    if not after.startswith(before):
        raise CohortError(f"the chat template rewrites earlier turns when {turn} is added, so the model's tokens "
                          "cannot be kept; use a prefix-preserving template")
    tail = ""
    if eos_text and eos_text in before:
        tail = before[before.rindex(eos_text) + len(eos_text):]
    return tail + after[len(before):]
