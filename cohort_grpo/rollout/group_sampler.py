"""`GroupSampler`: Algorithm 1's "sample G outputs for each question from π_old" as a stage.

Prompt rows in, a `Batch` out: each prompt rendered as training, evaluation and SFT render it
(`tasks.prompt_text`), its G completions sampled by the `Sampler` (the engine, or Hugging Face
`generate`), and decoded back to text, or to chat messages for chat prompts.

With tools (`Toolbox`), a completion may be several turns: the model calls a tool, the result is
appended, the model goes on (cohort_grpo/rollout/turns.py, cohort_grpo/tools/turns.py). Each completion can have
its own environment (TRL's `environment_factory`), reset on its row before sampling.
"""

from __future__ import annotations

from typing import Callable

from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.user_calls import exception_line
from cohort_grpo.tasks import prompt_text
from cohort_grpo.tools.environments import reset_environments, with_addition
from cohort_grpo.tools.toolbox import Toolbox
from cohort_grpo.rollout.batch import Batch
from cohort_grpo.rollout.images import ImagePrompts, row_images
from cohort_grpo.rollout.sampler import Sampler, SamplingParams

LONG_PROMPT_FIX = ("raise --max_prompt_length, filter long prompts out of the data, or pass --long_prompts "
                   "truncate_left to keep each one's last max_prompt_length tokens")


class GroupSampler:
    def __init__(self, sampler: Sampler, tokenizer, args, pad_id: int, toolbox: Toolbox | None = None,
                 images: ImagePrompts | None = None):
        self.sampler, self.tokenizer, self.args, self.pad_id = sampler, tokenizer, args, pad_id
        self.toolbox, self.images = toolbox, images  # images: a vision-language model's prompt renderer
        self.schemas = toolbox.schemas() if toolbox is not None and toolbox.environment_factory is None else None

    def __call__(self, rows: list[dict], seed: int, sequence_offset: int = 0) -> Batch:
        """G completions for each of `rows`. `seed` keys the sampling noise; `sequence_offset` is the
        global index of this rank's first completion (several ranks draw what one would)."""
        G = self.args.num_generations
        params = self.sampling_params(seed, sequence_offset)
        completion_rows = [r for r in rows for _ in range(G)]
        environments = turns = sampled_prompts = None
        if self.images is not None:
            return self.sample_with_images(rows, params)
        if self.toolbox is not None and self.toolbox.environment_factory is not None:
            # One environment per completion: the G completions of a prompt must not share state.
            environments, additions = reset_environments(self.toolbox.environment_factory, completion_rows)
            sampled_prompts = [with_addition(r["prompt"], a) for r, a in zip(completion_rows, additions)]
            prompt_ids = [self.encode_prompt(p, self.toolbox.schemas(env))
                          for p, env in zip(sampled_prompts, environments)]
            turns = self.toolbox.turns(self.tokenizer, len(prompt_ids), environments)
            # Completion i*G+g keeps its global index (and so its sampling noise) with one prompt per row.
            rollout = self.sampler.generate(prompt_ids, 1, params, turns=turns)
        else:
            distinct = [self.encode_prompt(r["prompt"], self.schemas) for r in rows]
            prompt_ids = [p for p in distinct for _ in range(G)]
            if self.toolbox is not None:
                turns = self.toolbox.turns(self.tokenizer, len(prompt_ids))
            # A sampler without tools is called as the plain `Sampler` protocol (user samplers need no `turns`).
            rollout = (self.sampler.generate(distinct, G, params) if turns is None else
                       self.sampler.generate(distinct, G, params, turns=turns))
        chat = isinstance(rows[0]["prompt"], list)
        if turns is not None and chat:
            completions = [turns.conversation(i, ids[m.bool()].tolist(), t[m.bool()].tolist()) for i, (ids, m, t) in
                           enumerate(zip(rollout.completion_ids, rollout.completion_mask, rollout.tool_mask))]
        else:
            completions = self.decode(rows, rollout)
        return Batch(rows=completion_rows, prompt_ids=prompt_ids, rollout=rollout, completions=completions,
                     environments=environments, sampled_prompts=sampled_prompts,
                     rollout_metrics=None if turns is None else turns.metrics(len(completion_rows)))

    def sample_with_images(self, rows: list[dict], params: SamplingParams) -> Batch:
        """G completions for each of `rows` of a vision-language model: each prompt rendered with its images by the
        processor, its images encoded once at its prefill (a text row samples as text)."""
        G = self.args.num_generations
        distinct, images = [], []
        for row in rows:
            loaded = row_images(row)
            if loaded is None:
                ids, inputs = self.encode_prompt(row["prompt"]), None
            else:
                ids, inputs = self.images.encode(row["prompt"], loaded)
                self.check_length(len(ids))
            distinct.append(ids)
            images.append(inputs)
        rollout = self.sampler.generate(distinct, G, params, images=images)
        return Batch(rows=[r for r in rows for _ in range(G)], prompt_ids=[p for p in distinct for _ in range(G)],
                     rollout=rollout, completions=self.decode(rows, rollout),
                     images=[inputs for inputs in images for _ in range(G)])

    def sampling_params(self, seed: int, sequence_offset: int = 0) -> SamplingParams:
        """The run's sampling settings for one call (`seed` and `sequence_offset` key its noise)."""
        args = self.args
        return SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, eos_token_ids=[self.tokenizer.eos_token_id],
            pad_token_id=self.pad_id, seed=seed, sequence_offset=sequence_offset)

    def decode(self, rows: list[dict], rollout) -> list:
        """Each completion as text, or as an assistant message for chat prompts (rows: one per completion)."""
        texts = [self.tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
                 for ids, m in zip(rollout.completion_ids, rollout.completion_mask)]
        return [[{"role": "assistant", "content": t}] for t in texts] if isinstance(rows[0]["prompt"], list) else texts

    def prompt_ids(self, prompt, tools: list[dict] | None = None) -> list[int]:
        """The prompt's tokens, whole: the same rendering as evaluation and SFT."""
        text = prompt_text(self.tokenizer, prompt, tools, self.args.chat_template_kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_prompt(self, prompt, tools: list[dict] | None = None) -> list[int]:
        ids = self.prompt_ids(prompt, tools)
        if len(ids) > self.args.max_prompt_length and self.args.long_prompts == "truncate_left":
            return ids[-self.args.max_prompt_length:]
        self.check_length(len(ids))
        return ids

    def check_length(self, length: int) -> None:
        limit = self.args.max_prompt_length
        if length > limit:
            fix = ("raise --max_prompt_length or use smaller images (a prompt's images cannot be cut)"
                   if self.images is not None else LONG_PROMPT_FIX)
            raise CohortError(f"a prompt has {length} tokens, more than max_prompt_length={limit}; {fix}")

    def check_prompt_lengths(self, rows: list[dict], name: str, origin: Callable[[int], str] | None = None,
                             log: Callable[[str], None] = print) -> None:
        """Before step 1, one pass over `rows` as sampling encodes them: a prompt its chat template cannot render
        or one longer than max_prompt_length is refused in one line naming its row (`origin(index)`: where the
        row comes from, e.g. its file and line; else the row of `name`), not when a later step samples it. With
        long_prompts=truncate_left the long ones are counted in one line instead. Rows an environment rewrites
        when it resets are checked as they are sampled."""
        if self.toolbox is not None and self.toolbox.environment_factory is not None:
            return
        limit, cut = self.args.max_prompt_length, 0
        def where(index: int) -> str:
            return origin(index) if origin is not None else f"{name} row {index}"

        for index, row in enumerate(rows):
            if self.images is not None and row_images(row) is not None:
                continue  # its length depends on its images, measured when it is sampled
            try:
                length = len(self.prompt_ids(row["prompt"], self.schemas))
            except Exception as error:  # noqa: BLE001 - a template's own error, named with its row
                raise CohortError(f"{where(index)}: the prompt cannot be rendered with the chat template "
                                  f"({exception_line(error)}); fix or drop that row") from error
            if length <= limit:
                continue
            if self.args.long_prompts != "truncate_left":
                raise CohortError(f"{where(index)}: the prompt has {length} tokens, more than max_prompt_length={limit}; "
                                  f"{LONG_PROMPT_FIX}")
            cut += 1
        if cut:
            log(f"long_prompts=truncate_left: {cut} of {len(rows)} prompts of {name} are longer than "
                f"max_prompt_length={limit}; they keep their last {limit} tokens")
