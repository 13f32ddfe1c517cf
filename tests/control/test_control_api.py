"""The control API's routes (meshd/control/api.py) over a fake view of the controller: what a bad call is
answered, what reaches the audit trail. The real controller behind them is tested in test_controller.py and
test_security.py."""

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from meshd.control import api
from meshd.nodes.agentclient import AgentError

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}", api.USER_HEADER: "ops@host"}


class FakeControl:
    mesh, tls, proxy_url, nodes = "m", False, "http://127.0.0.1:9", ("n0", "n1")  # no proxy listens on port 9

    def __init__(self):
        self.rows, self.asked = [], []

    def now(self):
        return {"phase": "ready", "generation": 4}

    def problems(self):
        return []

    def record(self, row):
        self.rows.append((row.user, row.action, row.outcome))

    async def down(self, force):
        self.asked.append(("down", force))

    async def node_log(self, node, rank_log, generation, lines, after):
        self.asked.append((node, rank_log, generation, lines, after))
        if generation == 404:
            raise AgentError("n1: no such generation", 404)
        if generation == 502:
            raise AgentError("n1: not reached")
        return {"lines": ["x"], "offset": 2}


CALLS = [
    ("no token", "GET", "/v1/status", {}, None, 401, [("", "GET /v1/status", "missing or wrong token")], []),
    ("down, its force no boolean", "POST", "/v1/down", AUTH, {"force": "yes"}, 400, [], []),
    ("down --force", "POST", "/v1/down", AUTH, {"force": True}, 202, [("ops@host", "down --force", "accepted")],
     [("down", True)]),
    ("a node's rank log", "GET", "/v1/logs/n1?lines=5&after=7", AUTH, None, 200, [], [("n1", True, 4, 5, 7)]),
    ("the agent's own log", "GET", "/v1/logs/n0?source=agent", AUTH, None, 200, [], [("n0", False, 4, 100, None)]),
    ("a node not in the mesh", "GET", "/v1/logs/n9", AUTH, None, 404, [], []),
    ("lines no integer", "GET", "/v1/logs/n1?lines=all", AUTH, None, 400, [], []),
    ("a source that is neither", "GET", "/v1/logs/n1?source=kernel", AUTH, None, 400, [], []),
    ("a generation that never ran there", "GET", "/v1/logs/n1?generation=404", AUTH, None, 404, [],
     [("n1", True, 404, 100, None)]),
    ("an agent not reached", "GET", "/v1/logs/n1?generation=502", AUTH, None, 502, [],
     [("n1", True, 502, 100, None)]),
]


@pytest.mark.parametrize("name,method,path,headers,body,status,rows,asked", CALLS, ids=[c[0] for c in CALLS])
def test_a_call(name, method, path, headers, body, status, rows, asked):
    async def call():
        ctl = FakeControl()
        app = api.routes(ctl, CollectorRegistry(), TOKEN)
        async with aiohttp.ClientSession() as ctl.session, TestClient(TestServer(app)) as client:
            r = await client.request(method, path, headers=headers, json=body)
            answer = await r.json()
        assert r.status == status, answer
        assert ("error" in answer) == (status >= 400)
        assert [(u, a, o.removeprefix("refused: ")) for u, a, o in ctl.rows] == rows
        assert ctl.asked == asked

    asyncio.run(call())
