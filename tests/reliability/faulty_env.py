"""A Corridor server with faults on demand, for the reliability tests.

    python tests/reliability/faulty_env.py --port P [--delay S] [--hang-task N] [--fail]
        [--op-timeout S]

--delay: seconds per step (a slow game, so that a test can act in the middle of a rollout);
--hang-task: steps of this task never return (a hung game); --fail: every step raises (a broken
game).
It prints the same "serving corridor on URL" line as `python -m env_server`.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from env_server.app import create_app, make_server  # noqa: E402
from env_server.corridor import CorridorEnv  # noqa: E402


class FaultyCorridor(CorridorEnv):
    delay = 0.0
    hang_task: int | None = None
    fail = False

    def reset(self, idx: int) -> str:
        self.task = idx
        return super().reset(idx)

    def step(self, action: str):
        if self.fail:
            raise RuntimeError("injected fault: this game is broken")
        if self.task == self.hang_task:
            time.sleep(3600)
        time.sleep(self.delay)
        return super().step(action)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--hang-task", type=int, default=None)
    p.add_argument("--fail", action="store_true")
    p.add_argument("--op-timeout", type=float, default=60.0)
    a = p.parse_args()
    FaultyCorridor.delay, FaultyCorridor.hang_task, FaultyCorridor.fail = (
        a.delay, a.hang_task, a.fail)
    server = make_server(create_app(FaultyCorridor, op_timeout_s=a.op_timeout), "127.0.0.1", a.port)
    print(f"serving corridor on http://127.0.0.1:{server.effective_port}", flush=True)
    server.run()


if __name__ == "__main__":
    main()
