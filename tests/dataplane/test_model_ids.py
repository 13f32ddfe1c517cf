"""What a client learns of the models from meshd-proxy's `GET /v1/models`: their names (the served name and the
configured aliases), never where they lie on the server's disk. On a real meshd-proxy (its controller away: the
list comes from the config)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.waiting import wait_for
from meshd.config import load


@pytest.mark.parametrize("runtime,ids", [
    ({"aliases": ["org/demo-1b"]}, ["demo", "org/demo-1b"]),  # no model_name: the directory's name
    ({"aliases": ["org/demo-1b"], "args": {"model_name": "tiny"}}, ["tiny", "org/demo-1b"]),
], ids=["directory name", "model_name"])
def test_models_lists_the_model_names_never_the_path(tmp_path, demo_model, runtime, ids):
    mesh = write_mesh(tmp_path, make_agents(tmp_path, 1), demo_model, runtime=runtime)
    log = tmp_path / "proxy.log"
    proxy = subprocess.Popen([sys.executable, "-m", "meshd.dataplane.proxyd", "--config", str(mesh),
                              "--log-file", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: log.exists() and "meshd-proxy serving" in log.read_text(), 60, "the proxy to serve")
        models = requests.get(f"{load(mesh).proxy.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ids
        assert not any(str(tmp_path) in m["id"] or str(demo_model) in m["id"] for m in models)
    finally:
        proxy.terminate()
        proxy.wait(30)
