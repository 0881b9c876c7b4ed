"""`cohort-grpo chat`: talk to a (trained) model.

The conversation is rendered with the tokenizer's chat template (or plain "User:/Assistant:"
lines when it has none) and the reply is streamed as it is sampled. Decoding is incremental: one
KV-cache row holds the conversation so far, each new token is one single-token forward, and a new
turn only runs the tokens the cache does not already hold (the longest common prefix is reused).
Our own models use cohort's `KVCache`; any other model uses Hugging Face's `past_key_values`. Tools
(--tools, --environment, a model folder's tools.json) are run by `chat_tools.ToolChatSession`; images
(--image, /image) on a vision-language model are rendered and prefilled as in training (`chat_images`).
`cohort-grpo generate` is generate.py.
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
from cohort_grpo.cli.chat_images import ChatImages, ConversationImages, holds_images, image_command_path, reusable_prefix

FALLBACK_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
FALLBACK_STOPS = ["\nUser:"]  # the plain format has no end-of-turn token: the next "User:" line ends a reply


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


def load_for_inference(spec: str | None, device: str = "auto", dtype: str = "auto", log=print, impl: str = "auto"):
    """(model in eval mode, tokenizer, device) for chat / generate; bf16 on CUDA unless told otherwise; `impl`:
    --model_impl, as in train."""
    from cohort_grpo.run.policy import load_policy

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CohortError(f"--device {device} asked for, but no CUDA GPU is available; use --device cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "auto"
    model, tokenizer = load_policy(spec, device=device, dtype=dtype, log=log, impl=impl)
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
    the last one; `rewind(n)` forgets everything after the first n tokens. A vision-language model's
    conversation with images starts over with them (`start_over`): the run from token 0 takes the images."""

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
        self.images: ConversationImages | None = None  # the images the held tokens stand for
        self.image_token_id = getattr(self.model, "image_token_id", None) if getattr(
            self.model, "takes_images", False) else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def start_over(self, images: ConversationImages | None) -> None:
        """Forget every token; the next extend runs from token 0 with `images` (a fresh cache: no rope delta of
        earlier images left in it)."""
        self.tokens, self.cache, self.images = [], None, images

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
            # the images run with the tokens from 0 (a start over, or the cache grown), as the engine's prefill
            images = {"images": [self.images.inputs]} if start == 0 and self.images is not None else {}
            hidden = self.model(input_ids, positions, kv_cache=self.cache, return_hidden=True, cache_len=end,
                                **images)
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
    """A conversation with a model: `reply(text, on_text)` streams the answer and keeps the history;
    `attach_image(path)` puts an image in the next message (a vision-language model's)."""

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
        self.images = ChatImages(model)

    def reset(self) -> None:
        """Forget the conversation and the images waiting for the next message (the cache is rewound lazily: the
        next prompt shares no prefix)."""
        self.history = []
        self.images.clear()

    def attach_image(self, path: str, option: str = "/image") -> None:
        """The image file at `path` goes with the next message; `option` names the flag or command in errors."""
        refusal = ("--raw completes each line as it is, with no chat template to place an image: drop --raw"
                   if self.raw else "images with tools are not supported yet: chat with --tools none to send "
                   "images" if self.tool_schemas is not None else None)
        self.images.attach(path, option, refusal)

    def messages(self, user_content) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history + [{"role": "user", "content": user_content}]

    def prompt_for(self, user_content, turns: list[dict] = ()) -> tuple[list[int], ConversationImages | None]:
        """The conversation's tokens, with `turns` (this reply's tool calls and results) after the message, and its
        images where it holds some (rendered by the model's processor, as training renders them); the oldest
        exchanges (a user message and all up to the next) are dropped when it outgrows the context."""
        limit = context_length(self.model) - 1
        while True:  # raw mode has no history: one pass
            conversation = self.messages(user_content) + list(turns)
            images = None
            if holds_images(conversation):
                ids, images = self.images.render(conversation)
            else:
                ids = encode(self.tokenizer, user_content + "\n" if self.raw  # one input line is one prompt line
                             else format_messages(self.tokenizer, conversation, self.tool_schemas))
            if len(ids) <= limit or not self.history:
                break
            later = [i for i, message in enumerate(self.history) if i and message["role"] == "user"]
            self.history = self.history[later[0] if later else len(self.history):]
            self.notice(f"(the conversation outgrew the model's {limit + 1}-token context: dropped the oldest exchange)")
        if len(ids) > limit:
            raise CohortError(f"the message is {len(ids)} tokens, more than the model's {limit + 1}-token context; "
                              "send a shorter message" + (" or smaller images" if images is not None else ""))
        return ids, images

    def sample(self, logits: torch.Tensor) -> int:
        """The next token: greedy at temperature 0, else temperature + top-p (the engine's filters)."""
        logits = logits.float()
        if self.temperature == 0:
            return int(logits.argmax())
        filtered = filter_logits(scale_by_temperature(logits[None], self.temperature), top_p=self.top_p)[0]
        return int(torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=self.generator))

    def generate(self, prompt: list[int], on_text: Callable[[str], None],
                 images: ConversationImages | None = None) -> TextStream:
        """Sample and stream one turn after `prompt` (with its `images`), running only the tokens the cache does
        not hold."""
        shared = 0
        for cached, new in zip(self.decoder.tokens, prompt[:-1]):  # keep ≥1 token to feed: we need logits
            if cached != new:
                break
            shared += 1
        if reusable_prefix(prompt, shared, images, self.decoder.images, self.decoder.image_token_id):
            self.decoder.rewind(shared)
        else:
            self.decoder.start_over(images)
            shared = 0
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
        content = self.images.user_content(user_text)  # with the images attached since the last message
        prompt, images = self.prompt_for(content)
        answer = self.generate(prompt, on_text, images).text().strip()
        self.images.clear()
        if not self.raw:
            self.history += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        return answer


def chat_loop(session: ChatSession, stdin: TextIO, stdout: TextIO, stderr: TextIO, interactive: bool) -> int:
    """Read messages line by line until /exit or end of input; replies go to stdout, notices to stderr."""

    def show(piece: str) -> None:
        if piece:
            stdout.write(piece)
            stdout.flush()

    if interactive:
        images = ", /image PATH attaches an image to the next message" if session.images.prompts else ""
        stderr.write(f"commands: /reset clears the history{images}, /exit quits (or Ctrl-D)\n")
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
            if text == "/image" or text.startswith("/image "):
                path = image_command_path(text)
                try:
                    session.attach_image(path, "/image")
                    stderr.write(f"(image {path} attached to the next message)\n")
                except CohortError as error:  # the chat goes on: a typo in a path is not the end of it
                    stderr.write(f"cohort: error: {error}\n")
                continue
            if interactive:
                stdout.write("model> ")
            session.reply(text, show)
            stdout.write("\n")
            stdout.flush()
    except BrokenPipeError:  # `cohort-grpo chat ... | head -1`: the reader left
        return 0
    return 0


# ---- command line --------------------------------------------------------------------------------
def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
