"""OpenEnv environments: an environment server started on 127.0.0.1 by the run, driven through
`environment_factory`.

OpenEnv (PyPI `openenv-core`, the `openenv` extra) serves an environment over HTTP and WebSocket: `reset()`
gives the first observation, `step(action)` the next observation, a reward and whether the episode is
done. `OpenEnvServer("package.module:app")` starts that app with uvicorn in a subprocess this process owns
and stops it (leaving its `with` block, at `stop()`, or at exit, also after a failure).
`server.environments()` is the trainer's `environment_factory`: each completion's episode is one
WebSocket session (OpenEnv's own `GenericEnvClient`):

- reset → prompt: the first observation's text is appended to the prompt's last user turn;
- each model turn is an action (the text itself where the action has one required text field, else the
  turn read as the action's JSON object), `step` → the observation's text, appended as a user turn
  (masked out of the loss), until the environment says done or the completion's budget is spent;
- the reward is the sum of the episode's step rewards (`get_reward`, one reward function named
  `OpenEnvEpisode`).

A fault (the server gone, a step slower than `step_timeout_s`, a reply that is not an observation) ends
that episode with reward 0 and is counted in `env/faults`; the run goes on.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque

from cohort_grpo.errors import CohortError
from cohort_grpo.tools.environments import with_addition
from cohort_grpo.tools.episodes import Episode, EpisodeOver, EpisodeTurns
from cohort_grpo.tools.turns import tool_loop

INSTALL = 'pip install "cohort-grpo[openenv]" (or pip install openenv-core)'
HOST = "127.0.0.1"
FIELDS_NOT_SHOWN = ("done", "reward", "metadata")  # an observation's fields that are not its text
LOG_LINES_KEPT = 20  # the server's last log lines, kept to say why it stopped


def import_openenv_client():
    """OpenEnv's `GenericEnvClient`; without openenv-core, one line naming the package."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError:
        raise CohortError(f"OpenEnv environments need the openenv-core package, which is not installed: {INSTALL}") from None
    return GenericEnvClient


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


class OpenEnvServer:
    """An OpenEnv app (`module:attribute`, importable with `pythonpath` added) served by uvicorn on 127.0.0.1."""

    def __init__(self, app: str, *, port: int | None = None, pythonpath: list[str] | None = None,
                 startup_timeout_s: float = 60.0, env: dict | None = None):
        if ":" not in app:
            raise CohortError(f"OpenEnv app {app!r} is not module:attribute; e.g. my_env.server.app:app")
        self.app, self.port, self.pythonpath = app, port, list(pythonpath or [])
        self.startup_timeout_s, self.extra_env = startup_timeout_s, dict(env or {})
        self.process: subprocess.Popen | None = None
        self.log: deque[str] = deque(maxlen=LOG_LINES_KEPT)
        self.log_reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "OpenEnvServer":
        import_openenv_client()
        self.port = self.port or free_port()
        self.log.clear()
        paths = self.pythonpath + [p for p in [os.environ.get("PYTHONPATH")] if p]
        env = {**os.environ, **self.extra_env, "PYTHONPATH": os.pathsep.join(paths)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", self.app, "--host", HOST, "--port", str(self.port), "--log-level",
             "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # The server's log is read as it is written: an unread pipe fills (OpenEnv logs a traceback for each
        # session a client closes) and the server then blocks on its next write, answering nothing.
        self.log_reader = threading.Thread(target=self.read_log, args=(self.process.stderr, self.log),
                                           name="openenv-server-log", daemon=True)
        self.log_reader.start()
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                module = self.app.split(":")[0]
                self.stop()
                last = self.log[-1] if self.log else "no output"
                raise CohortError(f"the OpenEnv server {self.app} stopped as it started ({last}); check that the app "
                                  f"imports (python -c \"import {module}\")")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise CohortError(f"the OpenEnv server {self.app} did not answer /health within {self.startup_timeout_s:g} s "
                          "(raise startup_timeout_s for a slow app)")

    @staticmethod
    def read_log(stream, kept: deque) -> None:
        """Reads the server's log until it closes, keeping its last non-blank lines."""
        with stream:
            for line in iter(stream.readline, b""):
                text = line.decode(errors="replace").strip()
                if text:
                    kept.append(text)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        reader, self.log_reader = self.log_reader, None
        if reader is not None:
            reader.join(timeout=5)  # the log's end: what the server said last

    def __enter__(self) -> "OpenEnvServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def environments(self, **options) -> "OpenEnvEnvironment":
        """The trainer's `environment_factory` for this server (options: see `OpenEnvEnvironment`)."""
        if self.process is None:
            self.start()
        return OpenEnvEnvironment(self.url, **options)


def action_field(url: str) -> str | None:
    """The action's one required text field (from the server's /schema), or None when it has another shape."""
    try:
        with urllib.request.urlopen(f"{url}/schema", timeout=10) as reply:
            schema = json.loads(reply.read())["action"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CohortError(f"the OpenEnv server at {url} gave no action schema ({error}); pass action=") from None
    properties = schema.get("properties", {})
    required = [n for n in schema.get("required", []) if n != "metadata"]
    if len(required) == 1 and properties.get(required[0], {}).get("type") == "string":
        return required[0]
    return None


def observation_text(observation: dict) -> str:
    """An observation as text: its one text field, else its fields as JSON (done, reward and metadata left out)."""
    shown = {k: v for k, v in observation.items() if k not in FIELDS_NOT_SHOWN}
    texts = [v for v in shown.values() if isinstance(v, str)]
    return texts[0] if len(shown) == 1 and texts else json.dumps(shown, sort_keys=True)


def checked_result(result) -> tuple[dict, float, bool]:
    """(observation, reward, done) of a step's result; a reply of another shape is a fault."""
    observation, reward, done = result.observation, result.reward, result.done
    if not isinstance(observation, dict) or not isinstance(done, bool) or not (
            reward is None or (isinstance(reward, (int, float)) and not isinstance(reward, bool))):
        raise ValueError(f"malformed reply: observation {type(observation).__name__}, reward {reward!r}, done {done!r}")
    return observation, float(reward or 0.0), done


class OpenEnvEpisode:
    """One completion's episode: a WebSocket session with the server (the environment_factory's product)."""

    def __init__(self, source: "OpenEnvEnvironment"):
        self.source, self.client, self.prompt = source, None, None
        self.total, self.failed, self.steps = 0.0, False, 0
        self.fault: str | None = None  # why the episode did not start

    def reset(self, **row) -> str:
        """Opens the session and resets it; the first observation is the text appended to the prompt."""
        text = ""
        opening = asyncio.run_coroutine_threadsafe(self.source.open(self), tool_loop())
        try:
            text = opening.result(timeout=self.source.connect_timeout_s + self.source.step_timeout_s)
        except Exception as error:  # noqa: BLE001 - a server that cannot start the episode is that episode's fault
            opening.cancel()  # a session that opens late is closed, not left holding one of the server's slots
            self.failed, self.fault = True, f"{type(error).__name__}: {error}"
        self.prompt = with_addition(row["prompt"], text)
        return text

    def get_reward(self) -> float:
        return 0.0 if self.failed else self.total


class OpenEnvEnvironment:
    """`environment_factory` for an OpenEnv server at `url`. `action(text) -> dict` turns a model turn into
    the action (default: the action's one text field, else the turn as JSON); `observation(dict) -> str`
    writes an observation (default `observation_text`); `step_timeout_s` bounds each reset and step."""

    def __init__(self, url: str, *, action=None, observation=None, step_timeout_s: float = 30.0,
                 connect_timeout_s: float = 10.0):
        self.client_class = import_openenv_client()
        self.url, self.step_timeout_s, self.connect_timeout_s = url, step_timeout_s, connect_timeout_s
        field = None if action is not None else action_field(url)
        self.action = action or (lambda text: {field: text} if field else json.loads(text))
        self.observation = observation or observation_text

    def __call__(self) -> OpenEnvEpisode:
        return OpenEnvEpisode(self)

    async def open(self, episode: OpenEnvEpisode) -> str:
        """The episode's session, reset: its first observation's text (on a failure the session is closed)."""
        client = self.client_class(self.url, connect_timeout_s=self.connect_timeout_s,
                                   message_timeout_s=self.step_timeout_s)
        try:
            observation, _, _ = checked_result(await client.reset())
        except BaseException:
            await client.disconnect()
            raise
        episode.client = client
        return self.observation(observation)

    def episode_turns(self, tokenizer, environments: list, template_kwargs: dict | None = None) -> EpisodeTurns:
        return EpisodeTurns(tokenizer, environments, self.play, template_kwargs)

    async def play(self, episode: Episode, environment: OpenEnvEpisode) -> None:
        try:
            if environment.failed:
                raise ConnectionError(f"the OpenEnv episode did not start at {self.url} ({environment.fault})")
            while True:
                text, last = await episode.model_turn()
                result = await asyncio.wait_for(environment.client.step(self.action(text)), self.step_timeout_s)
                observation, reward, done = checked_result(result)
                environment.total += reward
                environment.steps += 1
                if done or last:
                    return
                episode.send([{"role": "user", "content": self.observation(observation)}])
        except EpisodeOver:  # the completion ended after the environment's last message: no fault
            return
        except Exception:
            environment.failed = True
            raise
        finally:
            if environment.client is not None:
                await environment.client.disconnect()
