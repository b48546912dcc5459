"""Environment servers speaking the AgentGym HTTP protocol. `python -m env_server NAME --port P`."""

import importlib

from .base import Env, StepResult, TaskError

# name -> "module:Class"; modules are imported only when used (BabyAI pulls in minigrid, SciWorld a JVM).
ENVS = {
    "textcraft": "env_server.textcraft:TextCraftEnv",
    "babyai": "env_server.babyai:BabyAIEnv",
    "sciworld": "env_server.sciworld:SciWorldEnv",
    "searchqa": "env_server.searchqa:SearchQAEnv",
    "corridor": "env_server.corridor:CorridorEnv",  # a sanity-check game for learning tests
}


def get_env_class(name: str) -> type[Env]:
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; choose from {sorted(ENVS)}")
    module, cls = ENVS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["ENVS", "Env", "StepResult", "TaskError", "get_env_class"]
