"""Per-sequence state: the host-side record of one completion and the device-side slot tensors.

A *slot* is one row of the preallocated KV cache. While a sequence runs, its decode state lives
in device tensors indexed by its slot (`SlotState`), so a decode step needs no host round trip;
the host-side `Sequence` is brought up to date only at check time (every few steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.rollout.sampler import Rollout
from cohort_grpo.rollout.turns import TURN_NOISE_STRIDE


@dataclass
class Sequence:
    """One completion to generate: output row `index` of the Rollout, from `prompt`."""

    index: int
    prompt: list[int]
    limit: int  # most new tokens it may produce (max_new_tokens, or less near max_seq_len)
    slot: int | None = None
    generated: int = 0  # tokens generated so far, as of the last check
    stop_checked_upto: int = 0  # generated tokens already scanned for stop strings
    tokens: torch.Tensor | None = None  # final generated tokens (CPU long), set when finished
    logprobs: torch.Tensor | None = None  # their sampling log-probs (CPU float32)
    routes: torch.Tensor | None = None  # a MoE model's experts per position of [prompt | tokens], int16
    sampled: torch.Tensor | None = None  # multi-turn: 1 where the model sampled the token, 0 where appended
    finish_reason: str | None = None
    # Multi-turn (see turns.py): the completion before the current turn (earlier turns and appended,
    # unsampled tokens), their sampling log-probs (0 on appended ones) and which of them the model sampled.
    turn: int = 0
    earlier: list[int] | None = None
    earlier_logprobs: list[float] | None = None
    earlier_sampled: list[int] | None = None
    budget: int = 0  # the first turn's limit: the whole completion's (set when a turn first ends)
    prompt_length: int = 0  # the first turn's prompt length (later turns' `prompt` holds the completion so far)
    images: object | None = None  # a vision-language prompt's images (models/vision_language.py's ImageInputs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_key(self) -> tuple:
        """What makes two sequences' prompts one: the tokens, and the images object where there is one (equal
        tokens may stand for different images)."""
        return tuple(self.prompt) if self.images is None else (self.images, *self.prompt)

    def noise_key(self, offset: int) -> int:
        """The `rows` key of this turn's sampling noise: the sequence's global index, shifted per turn."""
        return offset + self.index + self.turn * TURN_NOISE_STRIDE


class SlotState:
    """Device tensors holding every slot's decode state, updated in place by each decode step.

    For the sequence in slot `s`: `next_token[s]` is its last generated token, at absolute position
    `position[s]` (= prompt length + generated count - 1), the input of the next decode step;
    `generated[s]` counts its tokens so far, stored in `tokens[s, :generated[s]]` with their
    log-probs in `logprobs[s, ...]`; `finished[s]` turns true on EOS or at `limit[s]` tokens.
    An empty slot is finished, at position 0, so a decode step over it writes only its own row.
    The buffers have one spare column so a finished row's ignored write never clobbers a token.
    The tensors are allocated once; CUDA graphs read the same storage on every replay. So are the
    sampling inputs a captured step reads: the seed, `sequence[s]` (the global index of the
    sequence in slot s: the `rows` key of `gumbel_noise`, whose `draw` key is `generated[s]`, the
    index of the token being drawn) and up to `MAX_EOS_IDS` EOS ids (padded with -1, which never
    matches). Keying the noise by sequence and token index, never by slot or step count, makes
    the tokens independent of scheduling (batch size, slots, compaction) and of the split of a
    batch over ranks.
    """

    MAX_EOS_IDS = 8

    def __init__(self, num_slots: int, max_new_tokens: int, pad_token_id: int, device: torch.device):
        self.num_slots = num_slots
        self.max_new_tokens = max_new_tokens
        self.pad_token_id = pad_token_id
        long = dict(dtype=torch.long, device=device)
        self.next_token = torch.full((num_slots,), pad_token_id, **long)
        self.position = torch.zeros(num_slots, **long)
        self.generated = torch.zeros(num_slots, **long)
        self.limit = torch.ones(num_slots, **long)
        self.finished = torch.ones(num_slots, dtype=torch.bool, device=device)
        self.tokens = torch.full((num_slots, max_new_tokens + 1), pad_token_id, **long)
        self.logprobs = torch.zeros(num_slots, max_new_tokens + 1, dtype=torch.float32, device=device)
        self.sequence = torch.zeros(num_slots, **long)
        self.seed = torch.zeros((), **long)
        self.eos_ids = torch.full((self.MAX_EOS_IDS,), -1, **long)

    def begin(self, seed: int, eos_token_ids: list[int]) -> None:
        """Set the sampling inputs of one generate() call (in place: graphs keep reading them)."""
        if len(eos_token_ids) > self.MAX_EOS_IDS:
            raise CohortError(f"{len(eos_token_ids)} EOS token ids given; at most {self.MAX_EOS_IDS} are supported")
        self.seed.fill_(seed & 0x7FFFFFFF)
        self.eos_ids.fill_(-1)
        if eos_token_ids:
            self.eos_ids[: len(eos_token_ids)] = torch.tensor(eos_token_ids, dtype=torch.long)

    def fits(self, num_slots: int, max_new_tokens: int, pad_token_id: int) -> bool:
        return (
            num_slots <= self.num_slots
            and max_new_tokens <= self.max_new_tokens
            and pad_token_id == self.pad_token_id
        )

    def per_slot_tensors(self) -> list[torch.Tensor]:
        return [self.next_token, self.position, self.generated, self.limit, self.finished, self.tokens, self.logprobs,
                self.sequence]

    def step_tensors(self) -> list[torch.Tensor]:
        """Everything a decode step writes besides the KV cache (what a graph warm-up must restore)."""
        return self.per_slot_tensors()

    def start(self, slots: torch.Tensor, first_tokens: torch.Tensor, first_logprobs: torch.Tensor,
              prompt_lengths: torch.Tensor, limits: torch.Tensor, sequences: torch.Tensor) -> None:
        """Install freshly prefilled sequences (global indices `sequences`): their first sampled token
        sits at position = prompt length."""
        self.sequence[slots] = sequences
        self.next_token[slots] = first_tokens
        self.position[slots] = prompt_lengths
        self.generated[slots] = 1
        self.limit[slots] = limits
        self.tokens[slots] = self.pad_token_id
        self.logprobs[slots] = 0.0
        self.tokens[slots, 0] = first_tokens
        self.logprobs[slots, 0] = first_logprobs
        self.finished[slots] = (limits <= 1) | torch.isin(first_tokens, self.eos_ids)

    def advance(self, width: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Record one decode step's sampled `tokens` for slots [0, width); finished slots stay unchanged."""
        active = ~self.finished[:width]
        column = self.generated[:width, None]
        self.tokens[:width].scatter_(1, column, torch.where(active, tokens, self.pad_token_id)[:, None])
        self.logprobs[:width].scatter_(1, column, torch.where(active, logprobs, 0.0)[:, None])
        step = active.long()
        self.generated[:width] += step
        self.position[:width] += step
        self.next_token[:width] = torch.where(active, tokens, self.next_token[:width])
        done = (self.generated[:width] >= self.limit[:width]) | torch.isin(tokens, self.eos_ids)
        self.finished[:width] |= active & done

    def clear(self, slots: torch.Tensor) -> None:
        """Mark slots empty (finished, position 0) so decode steps over them stay harmless."""
        self.finished[slots] = True
        self.position[slots] = 0
        self.generated[slots] = 0
        self.next_token[slots] = self.pad_token_id

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the state of slots `source` to slots `target` (compaction), then clear `source`."""
        for tensor in self.per_slot_tensors():
            tensor[target] = tensor[source]
        self.clear(source)


def assemble_rollout(sequences: list[Sequence], pad_token_id: int, multi_turn: bool = False) -> Rollout:
    """The finished sequences, in index order, as one right-padded Rollout (on the CPU, like HFGenerateSampler);
    `multi_turn` adds the tool mask (1 on sampled tokens, 0 on appended ones)."""
    return Rollout.concatenate([sequence_rollout(seq, multi_turn) for seq in sorted(sequences, key=lambda s: s.index)],
                               pad_token_id)


def sequence_rollout(seq: Sequence, multi_turn: bool) -> Rollout:
    """One finished sequence as a rollout of one row."""
    count = len(seq.tokens)
    sampled = seq.sampled if seq.sampled is not None else torch.ones(count, dtype=torch.long)
    return Rollout(completion_ids=seq.tokens.long()[None], completion_mask=torch.ones((1, count), dtype=torch.long),
                   logprobs=seq.logprobs.float()[None], finish_reasons=[seq.finish_reason],
                   tool_mask=sampled.long()[None] if multi_turn else None,
                   routed_experts=None if seq.routes is None else seq.routes[None])
