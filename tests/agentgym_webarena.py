"""A stand-in for AgentGym's WebArena server, for tests: its HTTP protocol exactly, over a
three-page fake shop instead of real web sites, a browser and WebArena's evaluators.

The protocol, as that server speaks it:
- `GET /` answers the plain text "ok"; there is no /tasks and no /available_actions;
- `POST /create` -> `{"env_idx": n}`;
- `POST /reset {"env_idx", "seed", "idx"}` -> `{"observation": <the page's accessibility tree>}`;
  the task is read from config_files/<idx>.json (here: TASKS[idx]);
- `GET /observation?env_idx=` -> a JSON string: the agent's prompt for this turn (page tree, URL,
  objective, previous action), in the layout of that server's prompt template;
- `POST /step {"env_idx", "action"}` with the model's whole reply: the server takes the text of the
  first ```...``` block as the action; a reply it cannot parse, or an action that fails, comes back
  as the observation (reward 0, not terminated); `stop [answer]` terminates and the evaluator gives
  the reward (here: exact match with the task's answer). -> `{"observation", "reward",
  "terminated", "truncated", "info"}`;
- `POST /close {"env_idx"}` answers the plain text "closed";
- a caller's mistake (an unknown env_idx) is an unhandled exception there: HTTP 500 with an HTML
  page.
`truncated` turns true after MAX_STEPS actions, so that clients can be tested on it.
"""

from __future__ import annotations

import re

from flask import Flask, jsonify, request

PAGES = {
    "http://shop.test/": [(1, "RootWebArea", "One Stop Shop"), (3, "link", "Blue Mug"),
                          (4, "link", "Red Kettle"), (5, "searchbox", "Search")],
    "http://shop.test/blue-mug": [(1, "RootWebArea", "Blue Mug"),
                                  (7, "StaticText", "Price: $12.50"),
                                  (8, "button", "Add to Cart")],
    "http://shop.test/red-kettle": [(1, "RootWebArea", "Red Kettle"),
                                    (7, "StaticText", "Price: $30.00"),
                                    (8, "button", "Add to Cart")],
}
LINKS = {("http://shop.test/", 3): "http://shop.test/blue-mug",
         ("http://shop.test/", 4): "http://shop.test/red-kettle"}
TASKS = [
    {"intent": "What is the price of the Blue Mug?", "start_url": "http://shop.test/",
     "answer": "$12.50"},
    {"intent": "What is the price of the Red Kettle?", "start_url": "http://shop.test/",
     "answer": "$30.00"},
    {"intent": "What is the name of the shop?", "start_url": "http://shop.test/",
     "answer": "One Stop Shop"},
]
# The solution of each task, as ``` actions: what a perfect agent sends.
SOLUTIONS = [["click [3]", "stop [$12.50]"], ["click [4]", "stop [$30.00]"],
             ["stop [One Stop Shop]"]]
MAX_STEPS = 6
_BLOCK = re.compile(r"```((.|\n)*?)```")


def tree(url: str) -> str:
    return "\n".join(f"[{i}] {role} '{name}'" for i, role, name in PAGES[url])


def create_app() -> Flask:
    app = Flask("agentgym_webarena_stand_in")
    envs: dict[int, dict] = {}

    def prompt(e: dict) -> str:
        return (f"OBSERVATION:\n{tree(e['url'])}\nURL: {e['url']}\n"
                f"OBJECTIVE: {e['task']['intent']}\n"
                f"PREVIOUS ACTION: {e['history'][-1]}")

    @app.get("/")
    def hello():
        return "ok"

    @app.post("/create")
    def create():
        envs[len(envs)] = {"task": None}
        return jsonify({"env_idx": len(envs) - 1})

    @app.post("/reset")
    def reset():
        q = request.json
        e = envs[q["env_idx"]]  # an unknown id raises: HTTP 500, as there
        task = TASKS[q["idx"]]
        e.update(task=task, url=task["start_url"], history=["None"], steps=0)
        return jsonify({"observation": tree(e["url"])})

    @app.get("/observation")
    def observation():
        return jsonify(prompt(envs[request.args.get("env_idx", type=int)]))

    @app.post("/step")
    def step():
        q = request.json
        e = envs[q["env_idx"]]
        m = _BLOCK.search(q["action"])
        if m is None:
            return jsonify({"observation": f"Cannot parse action from response {q['action']}",
                            "reward": 0, "terminated": False, "truncated": False, "info": None})
        action = m.group(1).strip()
        e["steps"] += 1
        e["history"].append(action)
        reward, terminated = 0.0, False
        if stop := re.fullmatch(r"stop \[(.*)\]", action):
            terminated = True
            reward = float(stop.group(1).strip() == e["task"]["answer"])
        elif click := re.fullmatch(r"click \[(\d+)\]", action):
            target = LINKS.get((e["url"], int(click.group(1))))
            if target is None:
                return jsonify({"observation": f"No clickable element with id {click.group(1)}",
                                "reward": 0, "terminated": False, "truncated": False, "info": None})
            e["url"] = target
        elif action == "go_back":
            e["url"] = e["task"]["start_url"]
        return jsonify({"observation": prompt(e), "reward": reward, "terminated": terminated,
                        "truncated": e["steps"] >= MAX_STEPS, "info": {"page": e["url"]}})

    @app.post("/close")
    def close():
        envs[request.json["env_idx"]]["task"] = None
        return "closed"

    return app
