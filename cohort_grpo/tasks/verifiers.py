"""verifiers environments: `--task verifiers:ENV_ID[:key=value,...]`, or `VerifiersEnvironment(env)` from Python.

verifiers (PyPI `verifiers`, the `verifiers` extra) packages an RL environment as a dataset (chat prompts
with the environment's system prompt, answers, info), a parser and a rubric (reward functions with
weights), and for multi-turn environments an `env_response` that answers each model turn until a stop
condition holds. This module trains such an environment as it is, through the classic API
(`Environment`, `SingleTurnEnv`, `MultiTurnEnv`, `Rubric`, `load_environment`): verifiers 0.3 ships it
(0.4 removed it in favour of its v1 taskset/harness stack, which this does not drive).

Each completion runs the environment's own `rollout` (its stop conditions, `env_response`, state) with a
client that is cohort's engine: the model's turns come from the engine, the environment's messages go
back to it rendered with the chat template and are masked out of the loss (cohort_grpo/tools/episodes.py).
A prompt's G rollouts are scored together by the environment's rubric (`score_group`: group reward
functions too); each rubric function becomes one reward function of the run, named after it and weighted
as the rubric weighs it (metrics with weight 0 are logged, not trained on), so the run's reward is the
rubric's. A rollout that fails outside the environment's own error handling is counted in `env/faults`
and scores 0.
"""

from __future__ import annotations

import ast
import asyncio
from functools import lru_cache

from cohort_grpo.errors import CohortError
from cohort_grpo.tools.episodes import Episode, EpisodeOver, EpisodeTurns
from cohort_grpo.tools.turns import tool_loop

FAMILY = "verifiers"
MODEL_NAME = "cohort"  # the model name an environment's rollout records
INSTALL = 'pip install "cohort-grpo[verifiers]" (or pip install "verifiers>=0.3,<0.4")'


def import_verifiers():
    """`verifiers` with its classic environments; else one line naming the package and the version."""
    try:
        import verifiers
    except ImportError:
        raise CohortError(f"verifiers environments need the verifiers package, which is not installed: {INSTALL}") from None
    try:
        verifiers.MultiTurnEnv
    except AttributeError:
        raise CohortError(f"verifiers {getattr(verifiers, '__version__', '?')} has no classic environments "
                          f"(Environment, MultiTurnEnv: removed in 0.4); {INSTALL}") from None
    return verifiers


def parse_spec(spec: str) -> tuple[str, dict]:
    """`ENV_ID` or `ENV_ID:key=value,key=value` → (env id, load_environment's keyword arguments); each
    value read as a Python literal (`n=100`, `hard=True`), else kept as text."""
    env_id, _, arguments = (spec or "").partition(":")
    if not env_id.strip():
        raise CohortError("--task verifiers needs the environment's id: --task verifiers:ENV_ID (an installed "
                          "verifiers environment), with its arguments as verifiers:ENV_ID:key=value,key=value")
    kwargs = {}
    for part in filter(None, (p.strip() for p in arguments.split(","))):
        key, sep, text = part.partition("=")
        if not sep or not key.strip().isidentifier():
            raise CohortError(f"verifiers environment {env_id}: argument {part!r} is not key=value; write "
                              f"--task verifiers:{env_id}:num_examples=100,difficulty=hard")
        try:
            kwargs[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = text.strip()
    return env_id.strip(), kwargs


def rubric_functions(rubric) -> list[tuple[object, float]]:
    """(function, weight) of a rubric, a rubric group's in order."""
    if hasattr(rubric, "rubrics"):
        return [pair for member in rubric.rubrics for pair in rubric_functions(member)]
    return list(zip(rubric.funcs, rubric.weights))


@lru_cache(maxsize=None)
def engine_client_class():
    """A verifiers `Client` whose responses are the model's turns from cohort's engine (made once verifiers
    is imported)."""
    vf = import_verifiers()
    from verifiers.types import Response, ResponseMessage

    class EngineClient(vf.Client):
        def __init__(self, episode: Episode):
            self.episode = episode

        async def get_response(self, prompt, model, sampling_args=None, tools=None, **kwargs):
            episode = self.episode
            if episode.last_turn_seen:  # the completion is over: no room for another turn
                raise vf.OverlongPromptError("the completion budget is spent")
            if episode.model_turns:
                seen = len(episode.history)
                if len(prompt) < seen or [m["role"] for m in prompt[:seen]] != [m["role"] for m in episode.history]:
                    raise RuntimeError("the environment rewrote earlier turns of the conversation; cohort trains "
                                       "on one growing conversation per rollout")
                episode.send([{"role": m["role"], "content": m["content"]} for m in prompt[seen:]])
            try:
                text, last = await episode.model_turn()
            except EpisodeOver:
                raise vf.OverlongPromptError("the completion budget is spent") from None
            message = ResponseMessage(content=text, finish_reason="length" if last else "stop", is_truncated=last)
            return Response(id=f"cohort-{episode.index}-{episode.model_turns}", created=0, model=model, message=message)

        # a client of a provider's API needs these; this one answers get_response itself
        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, *args, **kwargs):
            raise NotImplementedError

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            return response

        async def close(self):
            return None

    return EngineClient


class VerifiersRollout:
    """One completion's environment (the environment_factory's product): its dataset row, then the
    environment's rollout state and the rubric's scores."""

    def __init__(self, source: "VerifiersEnvironment"):
        self.source, self.row, self.prompt = source, None, None
        self.state = None  # the environment's rollout state, once it has finished
        self.metrics: dict[str, float] | None = None  # the rubric's score per function, once scored

    def reset(self, **row) -> None:
        self.row, self.prompt = row, row["prompt"]


class VerifiersEnvironment:
    """A verifiers environment as cohort's `environment_factory`, with its rows and reward functions:

        source = VerifiersEnvironment(vf_env)
        GRPOTrainer(model, train_dataset=source.rows(), reward_funcs=source.reward_funcs,
                    environment_factory=source, args=GRPOConfig(reward_weights=source.reward_weights, ...))
    """

    def __init__(self, env):
        import_verifiers()
        self.env = env
        pairs = rubric_functions(env.rubric)
        names = [getattr(f, "__name__", repr(f)) for f, _ in pairs]
        if len(set(names)) != len(names):
            raise CohortError(f"the environment's rubric names two functions alike ({', '.join(names)}); each "
                              "rubric function becomes a reward named after it, so rename one")
        self.reward_funcs = [self.metric_reward(name) for name in names]
        self.reward_weights = [float(w) for _, w in pairs]

    def __call__(self) -> VerifiersRollout:
        return VerifiersRollout(self)

    def rows(self, n: int = -1, seed: int | None = None) -> list[dict]:
        """The environment's training rows (its `get_dataset`: prompts with its system prompt, answers, info)."""
        return [dict(row) for row in self.env.get_dataset(n=n, seed=seed)]

    def episode_turns(self, tokenizer, environments: list, template_kwargs: dict | None = None) -> EpisodeTurns:
        return EpisodeTurns(tokenizer, environments, self.play, template_kwargs)

    async def play(self, episode: Episode, rollout: VerifiersRollout) -> None:
        client = engine_client_class()(episode)
        rollout.state = await self.env.rollout(dict(rollout.row), client, MODEL_NAME, {})

    def score(self, rollouts: list) -> None:
        """The rubric's scores of the rollouts not yet scored, a prompt's rollouts (same `example_id`) together;
        a rollout without a state (a fault) scores 0 on every function."""
        groups: dict = {}
        for rollout in rollouts:
            if rollout.metrics is not None:
                continue
            if rollout.state is None:
                rollout.metrics = {}
                continue
            groups.setdefault(rollout.row.get("example_id", id(rollout)), []).append(rollout)
        for group in groups.values():
            states = [r.state for r in group]
            asyncio.run_coroutine_threadsafe(self.env.rubric.score_group(states), tool_loop()).result()
            for rollout in group:
                rollout.metrics = {k: float(v) for k, v in (rollout.state.get("metrics") or {}).items()}

    def metric_reward(self, name: str):
        def reward(prompts=None, completions=None, environments=None, **_) -> list[float]:
            if environments is None:
                raise CohortError(f"verifiers reward {name} needs the rollout's environments; pass "
                                  "environment_factory=VerifiersEnvironment(env) to the trainer")
            self.score(environments)
            return [r.metrics.get(name, 0.0) for r in environments]

        reward.__name__ = name
        return reward


class VerifiersTask:
    """`--task verifiers:ENV_ID[:key=value,...]`: an installed verifiers environment (`load_environment`)."""

    default_config = dict(output_dir="runs/verifiers")
    reads_data = False  # the environment brings its dataset

    def __init__(self, spec: str = ""):
        env_id, kwargs = parse_spec(spec)
        vf = import_verifiers()
        try:
            env = vf.load_environment(env_id, **kwargs)
        except (ImportError, AttributeError) as error:
            raise CohortError(f"verifiers environment {env_id!r} cannot be loaded ({error}); install it (prime env "
                              "install, or pip install its package) and check its id") from None
        self.name = f"{FAMILY}:{spec.replace(' ', '')}"
        self.environment_factory = VerifiersEnvironment(env)
        self.reward_funcs = self.environment_factory.reward_funcs
        self.reward_weights = self.environment_factory.reward_weights

    def load(self, split: str = "train", *, size: int | None = None, seed: int = 0, **_) -> list[dict]:
        if split != "train":
            raise CohortError(f"{self.name}: held-out evaluation of verifiers environments is not built; train only")
        return self.environment_factory.rows(n=size or -1)
