"""An OpenEnv environment for tests/test_openenv_environments.py, served by the test's own server process:
each step's reward is 1 when the action holds a digit, the episode is done after `STEPS` steps.
COUNTING_MODE=slow makes every step sleep; COUNTING_MODE=chatty makes every step write 64 KiB to the
server's stderr (more than a pipe holds); COUNTING_SESSIONS=N serves N sessions at once (64 by default);
COUNTING_MODE=malformed serves a WebSocket that answers a step with a reply that is no observation."""

import json
import os
import sys
import time

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

STEPS = 2
MODE = os.environ.get("COUNTING_MODE", "")
FIRST = "say a digit"


class SayAction(Action):
    message: str = Field(..., description="what the model says")


class HeardObservation(Observation):
    heard: str = Field(default="", description="what the environment heard, or its first words")


class CountingEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State(episode_id="counting", step_count=0)

    def reset(self, **kwargs) -> HeardObservation:
        self._state = State(episode_id="counting", step_count=0)
        return HeardObservation(heard=FIRST, done=False, reward=0.0)

    def step(self, action: SayAction, **kwargs) -> HeardObservation:
        if MODE == "slow":
            time.sleep(3)
        if MODE == "chatty":
            sys.stderr.write(("x" * 1023 + "\n") * 64)
            sys.stderr.flush()
        self._state.step_count += 1
        reward = 1.0 if any(c.isdigit() for c in action.message) else 0.0
        return HeardObservation(heard=f"heard {len(action.message)}", done=self._state.step_count >= STEPS,
                                reward=reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(CountingEnvironment, SayAction, HeardObservation, env_name="counting", max_concurrent_envs=int(os.environ.get("COUNTING_SESSIONS", "64")))

if MODE == "malformed":
    from fastapi import FastAPI, WebSocket

    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "healthy"}

    @app.get("/schema")
    def schema():
        return {"action": SayAction.model_json_schema(), "observation": HeardObservation.model_json_schema()}

    @app.websocket("/ws")
    async def session(websocket: WebSocket):
        await websocket.accept()
        while True:
            message = json.loads(await websocket.receive_text())
            if message["type"] == "reset":
                await websocket.send_text(json.dumps({"type": "observation", "data": {
                    "observation": {"heard": FIRST}, "reward": None, "done": False}}))
            elif message["type"] == "step":
                await websocket.send_text(json.dumps({"type": "observation", "data": {
                    "observation": "not an observation", "reward": "high", "done": "maybe"}}))
            else:
                break
