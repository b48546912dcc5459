"""Environment servers speaking the AgentGym HTTP protocol. `python -m env_server NAME --port P`.

Which games exist, and the class that serves each, is registered once, in agents.py
(`register_env`).
"""

from .base import Env, StepResult, TaskError


def get_env_class(name: str) -> type[Env]:
    """The class serving the registered game `name` (imported on first use)."""
    from env_server.agents import env_spec, server_class

    spec = env_spec(name)
    if spec.server is None:
        raise ValueError(f"{name!r} is served by another project (give its server's address with "
                         "--env-addr)")
    return server_class(spec)


def served_envs() -> list[str]:
    """The registered games this project serves."""
    from env_server.agents import ENVS

    return sorted(n for n, s in ENVS.items() if s.server is not None)


__all__ = ["Env", "StepResult", "TaskError", "get_env_class", "served_envs"]
