"""`cohort-grpo chat` and `cohort-grpo generate`: talk to a (trained) model, or complete a file of prompts.

chat: the conversation is rendered with the tokenizer's chat template (or plain "User:/Assistant:"
lines when it has none) and the reply is streamed as it is sampled. Decoding is incremental: one
KV-cache row holds the conversation so far, each new token is one single-token forward, and a new
turn only runs the tokens the cache does not already hold (the longest common prefix is reused).
Our own models use cohort's `KVCache`; any other model uses Hugging Face's `past_key_values`. Tools
(--tools, --environment, a model folder's tools.json) are run by `chat_tools.ToolChatSession`.

generate: every prompt of a .txt / .jsonl file through the batched engine (`cohort_grpo.rollout.make_sampler`),
one JSONL row per completion: `{"index", "prompt", "completion", "finish_reason", "num_tokens"}`. A .txt
line is a prompt with its newline, as the arithmetic task's prompts (and `chat --raw` lines) end: the
built-in model answers after the newline, and a file of the task's questions gets the task's completions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, TextIO

import torch

from cohort_grpo.rollout.sampling import filter_logits, scale_by_temperature
from cohort_grpo.errors import CohortError
from cohort_grpo.models.lora import base_model
from cohort_grpo.cli.chat_flags import generate_parser

FALLBACK_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
FALLBACK_STOPS = ["\nUser:"]  # the plain format has no end-of-turn token: the next "User:" line ends a reply
PROMPT_BATCH = 256  # prompts per engine call in `generate` (bounds memory; rows go out as they finish)


# ---- model and prompt format ---------------------------------------------------------------------
def default_model_spec(log: Callable[[str], None]) -> str | None:
    """No MODEL_DIR: the default run's output folder when `cohort-grpo train` has finished one, else None
    (the built-in tiny model's warm start)."""
    from cohort_grpo.config.output_dir import COMMAND_LINE_OUTPUT_DIR
    from cohort_grpo.tasks import get_task

    candidates = [getattr(get_task("arithmetic"), "default_config", {}).get("output_dir"), COMMAND_LINE_OUTPUT_DIR]
    for folder in candidates:
        if folder and (Path(folder) / "config.json").is_file():
            log(f"cohort: no MODEL_DIR given; using the trained model in {folder}")
            return folder
    log("cohort: no MODEL_DIR given and no finished run in runs/; using the built-in tiny model's warm start")
    return None


def load_for_inference(spec: str | None, device: str = "auto", dtype: str = "auto", log=print):
    """(model in eval mode, tokenizer, device) for chat / generate; bf16 on CUDA unless told otherwise."""
    from cohort_grpo.run.policy import load_policy

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CohortError(f"--device {device} asked for, but no CUDA GPU is available; use --device cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "auto"
    model, tokenizer = load_policy(spec, device=device, dtype=dtype, log=log)
    model.eval()
    return model, tokenizer, torch.device(device)


def stop_token_ids(tokenizer, model_spec: str | None = None) -> list[int]:
    """The tokenizer's EOS plus the model folder's generation_config.json EOS ids (instruct models
    often end a turn with a token, e.g. <|im_end|>, that is not the tokenizer's EOS)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = Path(model_spec) / "generation_config.json" if model_spec else None
    if config is not None and config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            eos = None
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    if not ids:
        raise CohortError("the tokenizer has no EOS token, so a reply could never end; set tokenizer.eos_token")
    return sorted(ids)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text for a conversation (and the tools' JSON schemas), ending where the reply starts."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    lines = [f"{FALLBACK_ROLES.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def encode(tokenizer, text: str) -> list[int]:
    # The chat template already writes any BOS it wants; raw prompts are taken as they are (as in training).
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def context_length(model) -> int:
    config = model.config
    return int(getattr(config, "max_position_embeddings", None) or 4096)


# ---- incremental decoding ------------------------------------------------------------------------
class CachedDecoder:
    """One sequence's KV cache: `extend(ids)` runs only the new tokens and returns the logits after
    the last one; `rewind(n)` forgets everything after the first n tokens."""

    def __init__(self, model):
        from cohort_grpo.models import CausalLM, KVCache
        from cohort_grpo.models.generic import TransformersCausalLM

        base = base_model(model)  # PEFT: LoRA lives inside
        self.own = isinstance(base, (CausalLM, TransformersCausalLM))
        self.model = base if self.own else model
        self.tokens: list[int] = []
        self._kv_cache_type = KVCache
        self.cache = None  # KVCache (our models) or HF past_key_values
        self.forwards = 0  # model calls so far (tests check that a token costs one single-token call)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def rewind(self, length: int) -> None:
        if length >= len(self.tokens):
            return
        self.tokens = self.tokens[:length]
        # Our cache masks keys by position and the next tokens overwrite positions ≥ length before
        # anything reads them, so nothing needs clearing. HF's cache can only be cut with an API that
        # changed between transformers versions, and a linear-attention layer's recurrent state cannot be
        # rewound: drop the cache, and the next extend runs the kept tokens again.
        if not self.own or getattr(self.model, "keeps_recurrent_state", False):
            self.cache = None

    @torch.inference_mode()
    def extend(self, ids: list[int]) -> torch.Tensor:
        self.forwards += 1
        if self.own:
            end = len(self.tokens) + len(ids)
            if self.cache is None or self.cache.max_len < end:
                # Grow by doubling and run the held tokens again into the new cache: rare (log₂ of
                # the conversation length) and independent of the cache's internal layout.
                size = min(max(256, 2 * end), max(context_length(self.model), end))
                self.cache = self._kv_cache_type.for_model(self.model, 1, size)
                ids, self.tokens = self.tokens + list(ids), []
            start = len(self.tokens)
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            positions = torch.arange(start, end, device=self.device)[None]
            hidden = self.model(input_ids, positions, kv_cache=self.cache, return_hidden=True, cache_len=end)
            logits = self.model.lm_head(hidden[:, -1])[0]
        else:
            if self.cache is None:  # after a rewind: the kept tokens run again with the new ones
                ids, self.tokens = self.tokens + list(ids), []
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True)
            self.cache, logits = out.past_key_values, out.logits[0, -1]
        self.tokens.extend(ids)
        return logits


class TextStream:
    """Detokenize a growing list of tokens into text pieces safe to print now: a piece never ends in
    half a UTF-8 character (decoded as U+FFFD) nor in what may be the start of a stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.shown = 0  # characters of the text already handed out
        self.stopped = False

    def text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:
            self.stopped = True
            return text[: min(cuts)]
        return text

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.text()
        if self.stopped:
            return self._take(len(text), text)
        safe = len(text.rstrip("\ufffd"))
        held = max((k for s in self.stops for k in range(1, len(s)) if text[:safe].endswith(s[:k])), default=0)
        return self._take(safe - held, text)

    def finish(self) -> str:
        text = self.text()
        return self._take(len(text), text)

    def _take(self, upto: int, text: str) -> str:
        piece = text[self.shown : upto] if upto > self.shown else ""
        self.shown = max(self.shown, upto)
        return piece


class ChatSession:
    """A conversation with a model: `reply(text, on_text)` streams the answer and keeps the history."""

    def __init__(self, model, tokenizer, *, model_spec: str | None = None, system: str | None = None,
                 max_new_tokens: int = 256, temperature: float = 0.7, top_p: float = 1.0, seed: int | None = None,
                 raw: bool = False, notice: Callable[[str], None] = print):
        if max_new_tokens < 1:
            raise CohortError(f"--max_new_tokens={max_new_tokens}: it must be at least 1")
        if temperature < 0:
            raise CohortError(f"--temperature={temperature}: it must be >= 0 (0 = greedy)")
        if not 0.0 < top_p <= 1.0:
            raise CohortError(f"--top_p={top_p}: it must be in (0, 1]")
        self.model, self.tokenizer = model, tokenizer
        self.system, self.max_new_tokens, self.temperature, self.top_p = system, max_new_tokens, temperature, top_p
        self.eos_ids = set(stop_token_ids(tokenizer, model_spec))
        self.raw = raw  # each message is a prompt of its own, completed as it is: no format, no history
        self.stops = [] if has_chat_template(tokenizer) or raw else list(FALLBACK_STOPS)
        self.decoder = CachedDecoder(model)
        self.notice = notice
        self.generator = torch.Generator(device=self.decoder.device)
        self.generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, (1,)).item()))
        self.history: list[dict] = []
        self.tool_schemas: list[dict] | None = None  # what the chat template renders as the tools (chat_tools.py)

    def reset(self) -> None:
        """Forget the conversation (the cache is rewound lazily: the next prompt shares no prefix)."""
        self.history = []

    def messages(self, user_text: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history + [{"role": "user", "content": user_text}]

    def _prompt_ids(self, user_text: str, turns: list[dict] = ()) -> list[int]:
        """The conversation's tokens, with `turns` (this reply's tool calls and results) after the message; the
        oldest exchanges (a user message and all up to the next) are dropped when it outgrows the context."""
        limit = context_length(self.model) - 1
        while True:  # raw mode has no history: one pass
            conversation = self.messages(user_text) + list(turns)
            ids = encode(self.tokenizer, user_text + "\n" if self.raw  # one input line is one prompt line
                         else format_messages(self.tokenizer, conversation, self.tool_schemas))
            if len(ids) <= limit or not self.history:
                break
            later = [i for i, message in enumerate(self.history) if i and message["role"] == "user"]
            self.history = self.history[later[0] if later else len(self.history):]
            self.notice(f"(the conversation outgrew the model's {limit + 1}-token context: dropped the oldest exchange)")
        if len(ids) > limit:
            raise CohortError(f"the message is {len(ids)} tokens, more than the model's {limit + 1}-token context; "
                              "send a shorter message")
        return ids

    def sample(self, logits: torch.Tensor) -> int:
        """The next token: greedy at temperature 0, else temperature + top-p (the engine's filters)."""
        logits = logits.float()
        if self.temperature == 0:
            return int(logits.argmax())
        filtered = filter_logits(scale_by_temperature(logits[None], self.temperature), top_p=self.top_p)[0]
        return int(torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=self.generator))

    def generate(self, prompt: list[int], on_text: Callable[[str], None]) -> TextStream:
        """Sample and stream one turn after `prompt`, running only the tokens the cache does not hold."""
        shared = 0
        for cached, new in zip(self.decoder.tokens, prompt[:-1]):  # keep ≥1 token to feed: we need logits
            if cached != new:
                break
            shared += 1
        self.decoder.rewind(shared)
        logits = self.decoder.extend(prompt[shared:])
        stream = TextStream(self.tokenizer, self.stops)
        budget = min(self.max_new_tokens, context_length(self.model) - len(prompt))
        for _ in range(budget):
            token = self.sample(logits)
            if token in self.eos_ids:
                break
            on_text(stream.push(token))
            if stream.stopped or len(stream.ids) == budget:
                break
            logits = self.decoder.extend([token])
        on_text(stream.finish())
        return stream

    def reply(self, user_text: str, on_text: Callable[[str], None] = lambda piece: None) -> str:
        answer = self.generate(self._prompt_ids(user_text), on_text).text().strip()
        if not self.raw:
            self.history += [{"role": "user", "content": user_text}, {"role": "assistant", "content": answer}]
        return answer


def chat_loop(session: ChatSession, stdin: TextIO, stdout: TextIO, stderr: TextIO, interactive: bool) -> int:
    """Read messages line by line until /exit or end of input; replies go to stdout, notices to stderr."""

    def show(piece: str) -> None:
        if piece:
            stdout.write(piece)
            stdout.flush()

    if interactive:
        stderr.write("commands: /reset clears the history, /exit quits (or Ctrl-D)\n")
    try:
        while True:
            if interactive:
                stdout.write("you> ")
                stdout.flush()
            line = stdin.readline()
            if not line:  # end of input
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                session.reset()
                stderr.write("(history cleared)\n")
                continue
            if interactive:
                stdout.write("model> ")
            session.reply(text, show)
            stdout.write("\n")
            stdout.flush()
    except BrokenPipeError:  # `cohort-grpo chat ... | head -1`: the reader left
        return 0
    return 0


# ---- batch generation ----------------------------------------------------------------------------
def read_prompts(path: str | Path) -> list:
    """A .txt file (one prompt per non-empty line, each kept with its newline: the line as a training
    prompt ends, e.g. the arithmetic task's "12+7=? Reply <answer>N</answer>\n") or JSONL rows with a
    `prompt` column (a string, completed exactly as written, or a list of chat messages)."""
    path = Path(path)
    if not path.is_file():
        raise CohortError(f"--prompts {path}: no such file; pass a .txt (one prompt a line) or a .jsonl file")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix not in (".jsonl", ".json"):
        prompts = [line + "\n" for line in lines if line.strip()]
    else:
        prompts = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise CohortError(f"{path} line {number} is not valid JSON; fix or delete that line") from None
            prompt = row.get("prompt") if isinstance(row, dict) else None
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt))):
                raise CohortError(f"{path} line {number} has no 'prompt' string or message list; "
                                  "each row needs a 'prompt' column")
            prompts.append(prompt)
    if not prompts:
        raise CohortError(f"{path} holds no prompts; write one prompt per line (.txt) or JSONL rows with 'prompt'")
    return prompts


def generate_rows(model, tokenizer, prompts: list, *, model_spec: str | None = None, num_generations: int = 1,
                  max_new_tokens: int = 256, temperature: float = 0.7, top_p: float = 1.0, seed: int = 0,
                  system: str | None = None, as_chat: bool = False):
    """Yield `{"index", "prompt", "completion", "finish_reason", "num_tokens"}` for each completion,
    prompt by prompt (G rows each); `num_tokens` counts the generated tokens, EOS included.
    Message-list prompts (and, with `as_chat`, string prompts as one user message, without a trailing
    newline) are rendered as in training and evaluation (`cohort_grpo.tasks.prompt_text`: the chat template,
    or the contents one per line without one); other strings are completed exactly as they are."""
    from cohort_grpo.rollout import make_sampler
    from cohort_grpo.rollout.sampler import SamplingParams
    from cohort_grpo.tasks import prompt_text

    sampler = make_sampler(model, tokenizer)
    eos_ids = stop_token_ids(tokenizer, model_spec)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    limit = context_length(model)
    for start in range(0, len(prompts), PROMPT_BATCH):
        chunk = prompts[start : start + PROMPT_BATCH]
        texts = []
        for prompt in chunk:
            if isinstance(prompt, str) and as_chat:
                prompt = [{"role": "user", "content": prompt.removesuffix("\n")}]
            if isinstance(prompt, list) and system:
                prompt = [{"role": "system", "content": system}] + prompt
            texts.append(prompt_text(tokenizer, prompt))
        ids = [encode(tokenizer, text) for text in texts]
        for offset, prompt_ids in enumerate(ids):
            if not prompt_ids or len(prompt_ids) >= limit:
                raise CohortError(f"prompt {start + offset} has {len(prompt_ids)} tokens; it needs 1 to {limit - 1} "
                                  "(the model's context); shorten or drop it")
        params = SamplingParams(
            max_new_tokens=min(max_new_tokens, limit - max(len(p) for p in ids)), temperature=temperature,
            top_p=top_p, eos_token_ids=eos_ids, pad_token_id=pad_id, seed=seed + start,
        )
        rollout = sampler.generate(ids, num_generations, params)
        for row, (completion, mask) in enumerate(zip(rollout.completion_ids, rollout.completion_mask)):
            text = tokenizer.decode(completion[mask.bool()], skip_special_tokens=True)
            index = start + row // num_generations
            yield {"index": index, "prompt": prompts[index], "completion": text,
                   "finish_reason": rollout.finish_reasons[row], "num_tokens": int(mask.sum())}


# ---- command line --------------------------------------------------------------------------------
def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def generate_main(argv: list[str]) -> int:
    """`cohort-grpo generate [MODEL_DIR] --prompts FILE [--output out.jsonl] [options]`."""
    parser = generate_parser()
    args = parser.parse_args(argv)
    if args.num_generations < 1:
        raise CohortError(f"--num_generations={args.num_generations}: it must be at least 1")
    prompts = read_prompts(args.prompts)
    spec = args.model if args.model is not None else default_model_spec(stderr_log)
    model, tokenizer, _ = load_for_inference(spec, args.device, args.dtype, log=stderr_log)
    rows = generate_rows(model, tokenizer, prompts, model_spec=spec, num_generations=args.num_generations,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                         seed=args.seed if args.seed is not None else 0, system=args.system, as_chat=args.chat)
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    count = 0
    try:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
        out.flush()
    finally:
        if out is not sys.stdout:
            out.close()
    if args.output:
        stderr_log(f"cohort: wrote {count} completions to {args.output}")
    return 0
