"""No open door: agents speak TLS with certificates from the mesh CA and the
controller trusts that CA only; the control API off loopback speaks TLS only;
the status page off loopback wants the token once, for a cookie that opens the
page and nothing else; an open proxy off loopback is said at every start; a
flood of wrong tokens hides no accepted action from the audit trail. A real
two-rank mesh, its control API and proxy bound to every address, reached
through this machine's LAN address."""

import asyncio
import getpass
import json
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import psutil
import pytest
import requests

from common import tls
from common.tomlcheck import ConfigError
from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import meshctl, stop_controller
from meshd import config as mesh_config
from meshd.nodes.agentclient import AgentClient, AgentError, agent_session
from meshd.meshctl.ports import free_ports


def lan_address() -> str:
    """This machine's first address off loopback (what another machine on the LAN would call)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    raise AssertionError("this machine has no IPv4 address off loopback to test with")


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("tls")
    ca = tls.ensure_ca(tmp / "state" / "tls", "test")  # where `meshctl agents install` makes it
    agents = make_agents(tmp, 2, stall={"base": 10},
                         extra={"tls_cert_file": "tls/agent.pem", "tls_key_file": "tls/agent.key"})
    for a in agents:
        tls.ensure_issued(ca, tls.Pair(a.dir / "tls" / "agent.pem", a.dir / "tls" / "agent.key"), a.node,
                          ["127.0.0.1"])
        a.ca = ca.cert
        a.start()
    proxy_port, control_port = free_ports(2)
    mesh = write_mesh(tmp, agents, demo_model, proxy={"listen": f"0.0.0.0:{proxy_port}", "allow_open": True},
                      control={"listen": f"0.0.0.0:{control_port}"},
                      runtime={"args": {"max_tokens": 4, "max_context": 512, "model_name": "demo"}})
    up = meshctl(mesh, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    lan = lan_address()
    yield {"mesh": mesh, "agents": agents, "ca": ca, "tmp": tmp, "lan": lan,
           "control": f"https://{lan}:{control_port}", "proxy": f"http://{lan}:{proxy_port}/v1",
           "token": (tmp / "state" / "control.token").read_text().strip()}
    stop_controller(mesh)
    for a in agents:
        a.kill()


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    return tls.ensure_ca(tmp_path_factory.mktemp("other-ca"), "another")


def test_the_controller_drives_https_agents_and_the_mesh_serves(tls_mesh):
    status = json.loads(meshctl(tls_mesh["mesh"], "status", "--json").stdout)
    assert status["phase"] == "ready" and status["urls"]["control"].startswith("https://")
    r = requests.post(f"{tls_mesh['proxy']}/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_an_agent_refuses_plain_http_other_cas_and_wrong_tokens(tls_mesh, other_ca):
    a = tls_mesh["agents"][0]
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{a.port}/healthz", timeout=5)
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"{a.url}/v1/node", headers=a.headers(), verify=str(other_ca.cert), timeout=5)
    for auth in ({}, {"Authorization": "Bearer " + "0" * 32}, {"Authorization": a.token}):
        r = requests.get(f"{a.url}/v1/node", headers=auth, verify=str(a.ca), timeout=5)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert a.get("/v1/node").json()["node"] == a.node
    assert a.token not in (a.dir / "agent.log").read_text()


def test_the_control_api_off_loopback_speaks_tls_with_the_mesh_ca_only(tls_mesh, other_ca):
    url, token, ca = tls_mesh["control"], tls_mesh["token"], str(tls_mesh["ca"].cert)
    auth = {"Authorization": f"Bearer {token}"}
    assert requests.get(f"{url}/v1/status", headers=auth, verify=ca, timeout=10).json()["phase"] == "ready"
    assert requests.get(f"{url}/v1/status", verify=ca, timeout=10).status_code == 401
    for verify in (str(other_ca.cert), True):  # another CA, the system's roots
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(f"{url}/v1/status", headers=auth, verify=verify, timeout=10)
    with pytest.raises(requests.ConnectionError):
        requests.get(url.replace("https://", "http://") + "/v1/status", headers=auth, timeout=10)


def test_the_status_page_off_loopback_wants_the_token_once_for_a_page_only_cookie(tls_mesh):
    url, token, ca = tls_mesh["control"], tls_mesh["token"], str(tls_mesh["ca"].cert)
    form = requests.get(f"{url}/", verify=ca, timeout=10)
    assert form.status_code == 401 and 'name="token"' in form.text and "<td>node0</td>" not in form.text
    assert requests.get(f"{url}/?token={token}", verify=ca, timeout=10).status_code == 401  # never in a URL
    wrong = requests.post(f"{url}/login", data={"token": "0" * 48}, verify=ca, timeout=10, allow_redirects=False)
    assert wrong.status_code == 401 and "not the control token" in wrong.text

    browser = requests.Session()
    ok = browser.post(f"{url}/login", data={"token": token}, verify=ca, timeout=10, allow_redirects=False)
    assert ok.status_code == 303 and ok.headers["Location"] == "/"
    cookie = ok.headers["Set-Cookie"]
    assert token not in cookie and all(flag in cookie for flag in ("HttpOnly", "Secure", "SameSite=Strict"))
    page = browser.get(f"{url}/", verify=ca, timeout=10)
    assert page.status_code == 200 and "<td>node0</td>" in page.text
    assert browser.get(f"{url}/v1/status", verify=ca, timeout=10).status_code == 401  # the page only
    assert browser.post(f"{url}/v1/down", json={}, verify=ca, timeout=10).status_code == 401
    bearer = requests.get(f"{url}/", headers={"Authorization": f"Bearer {token}"}, verify=ca, timeout=10)
    assert bearer.status_code == 200


def test_an_open_proxy_off_loopback_is_said_at_start(tls_mesh):
    log = (tls_mesh["tmp"] / "state" / "run" / "proxy.log").read_text()
    assert "the proxy serves off loopback without API keys" in log
    assert tls_mesh["token"] not in log


def test_the_controllers_agent_client_trusts_the_mesh_ca_and_no_other(tls_mesh, other_ca, tmp_path):
    async def node_facts(cfg):
        async with agent_session(cfg) as session:
            return await AgentClient(cfg.nodes[0], session).call("GET", "/v1/node")

    cfg = mesh_config.load(tls_mesh["mesh"])
    assert asyncio.run(node_facts(cfg))["node"] == "node0"
    stranger = replace(cfg, state_dir=tmp_path / "state")  # the same mesh.toml with another CA beside it
    stranger.tls_dir.mkdir(parents=True)
    shutil.copy(other_ca.cert, stranger.ca_file)
    with pytest.raises(AgentError, match="Certificate"):
        asyncio.run(node_facts(stranger))
    with pytest.raises(ConfigError, match="no mesh CA"):
        asyncio.run(node_facts(replace(cfg, state_dir=tmp_path / "none")))


def test_control_actions_and_refusals_are_in_the_audit_trail(tls_mesh):
    requests.post(f"{tls_mesh['control']}/v1/restart", headers={"Authorization": "Bearer wrong"},
                  verify=str(tls_mesh["ca"].cert), timeout=10)
    audit = json.loads(meshctl(tls_mesh["mesh"], "events", "--json").stdout)["audit"]
    me = f"{getpass.getuser()}@{socket.gethostname()}"
    seen = {(a["action"], a["outcome"].split(":")[0], a["user"], a["remote"]) for a in audit}
    assert ("up", "accepted", me, "127.0.0.1") in seen  # meshctl up, through the control API
    assert ("POST /v1/restart", "refused", "", tls_mesh["lan"]) in seen
    assert ("status page login", "refused", "", tls_mesh["lan"]) in seen
    assert ("status page login", "accepted", "", tls_mesh["lan"]) in seen
    assert ("restart", "accepted") not in {(a["action"], a["outcome"]) for a in audit}
    text = meshctl(tls_mesh["mesh"], "events").stdout
    assert "control actions, newest first:" in text and f"up                 accepted  by {me}" in text
    store = (tls_mesh["tmp"] / "state" / "meshd.sqlite").read_bytes()
    assert tls_mesh["token"].encode() not in store and b"wrong" not in store


def test_a_flood_of_wrong_tokens_leaves_every_accepted_action_in_the_audit_trail(tls_mesh):
    mesh, url, ca = tls_mesh["mesh"], tls_mesh["control"], str(tls_mesh["ca"].cert)
    restart = meshctl(mesh, "restart")
    assert restart.returncode == 0, restart.stdout + restart.stderr

    def flood(_):
        with requests.Session() as s:
            return [s.post(f"{url}/v1/restart", headers={"Authorization": "Bearer wrong", "X-Meshd-User": "root@ops"},
                           verify=ca, timeout=60).status_code for _ in range(60)]

    with ThreadPoolExecutor(50) as pool:  # 3000 calls, 50 at a time
        answers = [code for codes in pool.map(flood, range(50)) for code in codes]
    assert answers == [401] * 3000
    me = f"{getpass.getuser()}@{socket.gethostname()}"
    text = meshctl(mesh, "events").stdout
    assert f"restart            accepted  by {me}" in text and f"up                 accepted  by {me}" in text, text
    audit = json.loads(meshctl(mesh, "events", "--json").stdout)["audit"]
    flooded = [a for a in audit if a["remote"] == tls_mesh["lan"] and a["action"] == "POST /v1/restart"]
    assert 1 <= len(flooded) <= 2 and all(a["outcome"].startswith("refused") for a in flooded), flooded
    assert "root@ops" not in {a["user"] for a in audit}, "a refused caller's claimed name is not a user"
