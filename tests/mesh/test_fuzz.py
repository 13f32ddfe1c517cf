"""Property-based fuzzing of what takes outside input: schemathesis against
the OpenAPI descriptions in openapi/ (proxy, control API, agent API) on a real
two-rank mesh and a real agent, and hypothesis against the config loaders.
Bad input must get a 4xx JSON error, never a 5xx, a hang or a crash, and the
mesh must still serve afterwards."""

import json
import string
import tomllib
from types import SimpleNamespace
from pathlib import Path

import psutil
import pytest
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance

from agents import config as agent_config
from agents.server import make_app
from agents.supervisor import Supervisor
from common.openai_api import Limits
from common.tomlcheck import dumps_toml
from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import meshctl, stop_controller
from meshd import config as mesh_config
from meshd.control.controller import Controller
from meshd.control.controllerd import control_app
from meshd.metrics import Metrics, ProxyMetrics
from meshd.dataplane.proxy import Proxy
from meshd.dataplane.proxyconfig import single
from meshd.seam import rank_key, rank_secret
from meshd.store import Store
from runtime.server import Frontend

OPENAPI = Path(__file__).resolve().parents[2] / "openapi"
EXAMPLES = 25


def load_schema(name: str):
    schema = schemathesis.openapi.from_path(OPENAPI / f"{name}.yaml")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                    max_examples=EXAMPLES, deterministic=True, database="none", allow_x00=True)
    return schema


proxy_schema = load_schema("proxy")
rank_schema = load_schema("rank")
control_schema = load_schema("control")
agent_schema = load_schema("agent")
CALL = {"timeout": 60}


PAGES = ("/", "/login")  # the status page and its login form answer HTML, as described


def check(case, response) -> None:
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
    if response.status_code >= 400 and case.operation.path not in PAGES:
        body = response.json()
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


@pytest.fixture(scope="module")
def fuzz_mesh(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("fuzz")
    agents = make_agents(tmp, 2, stall={"base": 10})
    for a in agents:
        a.start()
    mesh = write_mesh(tmp, agents, demo_model,
                      runtime={"args": {"max_tokens": 4, "max_tokens_limit": 8, "max_context": 512,
                                        "model_name": "demo"}})
    up = meshctl(mesh, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    status = json.loads(meshctl(mesh, "status", "--json").stdout)
    token = (tmp / "state" / "control.token").read_text().strip()
    secret = rank_secret(rank_key(tmp / "state"), status["generation"])
    rank0 = f"http://127.0.0.1:{tomllib.loads(mesh.read_text())['runtime']['port']}"
    yield {"proxy": status["urls"]["proxy"].removesuffix("/v1"), "control": status["urls"]["control"],
           "token": token, "mesh": mesh, "agents": agents, "rank0": rank0, "rank_secret": secret}
    stop_controller(mesh)
    for a in agents:
        a.kill()


@proxy_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_the_proxy_answers_bad_input_with_4xx_json(case, fuzz_mesh):
    check(case, case.call(base_url=fuzz_mesh["proxy"], **CALL))


@rank_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_rank0_answers_bad_input_with_4xx_json(case, fuzz_mesh):
    if case.operation.path == "/internal/drain":
        return  # a well-formed drain ends the mesh; the next test sends drains without the secret
    check(case, case.call(base_url=fuzz_mesh["rank0"],
                          headers={"Authorization": f"Bearer {fuzz_mesh['rank_secret']}"}, **CALL))


@rank_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=10)
def test_rank0_refuses_every_route_without_the_generations_secret(case, fuzz_mesh):
    for auth in ({}, {"Authorization": "Bearer " + "0" * 64}, {"Authorization": fuzz_mesh["rank_secret"]},
                 {"Authorization": f"Bearer {rank_secret('another mesh', 1)}"}):
        response = case.call(base_url=fuzz_mesh["rank0"], headers=auth, **CALL)
        assert response.status_code == 401, (auth, response.text)
        assert "rank secret" in response.json()["error"]["message"]


def test_a_generations_secret_opens_no_other_generation(fuzz_mesh):
    state = fuzz_mesh["mesh"].parent / "state"
    g = json.loads(meshctl(fuzz_mesh["mesh"], "status", "--json").stdout)["generation"]
    key = rank_key(state)
    for other in (g - 1, g + 1):
        r = requests.get(f"{fuzz_mesh['rank0']}/internal/ready",
                         headers={"Authorization": f"Bearer {rank_secret(key, other)}"}, timeout=10)
        assert r.status_code == 401, r.text
    r = requests.get(f"{fuzz_mesh['rank0']}/internal/ready",
                     headers={"Authorization": f"Bearer {rank_secret(key, g)}"}, timeout=10)
    assert r.status_code == 200 and r.json()["generation"] == g
    rank_logs = "".join(p.read_text(errors="replace") for p in state.parent.rglob("rank.log"))
    assert key not in rank_logs and rank_secret(key, g) not in rank_logs
    for a in fuzz_mesh["agents"]:
        (rank,) = [r for r in a.ranks() if r["generation"] == g]
        assert rank_secret(key, g) not in " ".join(psutil.Process(rank["pid"]).cmdline())  # environment only


@control_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_the_control_api_answers_bad_input_with_4xx_json(case, fuzz_mesh):
    """After the tests that need rank 0: a well-formed down or restart here ends the generation."""
    headers = {"Authorization": f"Bearer {fuzz_mesh['token']}"}
    if case.operation.path == "/v1/serving":
        case.query = {**(case.query or {}), "stream": "0"}  # the streaming form never ends by design
    if case.operation.path == "/v1/observations" and isinstance(case.body, dict) and type(
            case.body.get("generation")) is int:
        case.body = {**case.body, "generation": 0}  # evidence against the serving generation would end it
    check(case, case.call(base_url=fuzz_mesh["control"], headers=headers, **CALL))


def test_the_mesh_serves_after_the_fuzzing(fuzz_mesh):
    up = meshctl(fuzz_mesh["mesh"], "up")
    assert up.returncode == 0, up.stdout + up.stderr
    r = requests.post(f"{fuzz_mesh['proxy']}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    for a in fuzz_mesh["agents"]:
        assert a.proc.poll() is None and requests.get(f"{a.url}/healthz", timeout=5).ok


@pytest.fixture(scope="module")
def lone_agent(tmp_path_factory):
    (agent,) = make_agents(tmp_path_factory.mktemp("fuzz-agent"), 1)
    agent.start()
    yield agent
    assert agent.proc.poll() is None, "the agent crashed under fuzzing"
    assert requests.get(f"{agent.url}/healthz", timeout=5).ok
    agent.kill()


@agent_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_the_agent_api_answers_bad_input_with_4xx_json(case, lone_agent):
    if case.operation.path == "/v1/events":
        case.query = {**(case.query or {}), "stream": "0"}  # the streaming form never ends by design
    check(case, case.call(base_url=lone_agent.url, headers=lone_agent.headers(), **CALL))


# --- config loaders ----------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                    st.text(max_size=12))
values = st.recursive(scalars.filter(lambda v: v is not None),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(string.ascii_letters,
                                                                                          min_size=1, max_size=8),
                                                                                  inner, max_size=3),
                      max_leaves=6)


def mutate(base: dict, data) -> dict:
    """A valid config with one key (top level or in a table) replaced, dropped or added."""
    raw = json.loads(json.dumps(base))
    tables = [raw] + [v for v in raw.values() if isinstance(v, dict)] + \
        [n for v in raw.values() if isinstance(v, list) for n in v if isinstance(n, dict)]
    target = data.draw(st.sampled_from(tables))
    key = data.draw(st.sampled_from(sorted(target)) | st.text(string.ascii_lowercase + "_", min_size=1, max_size=12))
    if data.draw(st.booleans()):
        target.pop(key, None)
    else:
        target[key] = data.draw(values)
    return raw


MESH = {"name": "fuzz", "backend": "ring",
        "nodes": [{"name": "a", "agent": "http://127.0.0.1:7701", "token_file": "token"},
                  {"name": "b", "agent": "http://127.0.0.1:7702", "token_file": "token"}],
        "runtime": {"model": "/models/demo", "port": 8100}, "proxy": {"listen": "127.0.0.1:8000"},
        "recovery": {"ladder": ["restart"], "backoff_max": 10.0}, "control": {"listen": "127.0.0.1:8001"}}
AGENT = {"node": "a", "listen": "127.0.0.1:7701", "token_file": "token", "state_dir": "state",
         "profiles": {"p": {"command": ["{python}", "--meshd-generation", "{generation}"]}}}


def load_or_config_error(loader, path: Path, text: str):
    path.write_text(text)
    try:
        return loader(path)
    except (mesh_config.ConfigError, agent_config.ConfigError) as e:
        message = str(e)
        assert message and "Traceback" not in message
        return None


LOADERS = {"mesh.toml": (MESH, mesh_config.load),
           "agent.toml": (AGENT, lambda path: agent_config.load(path).token())}


@pytest.mark.parametrize("name", sorted(LOADERS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mangled_config_is_a_config_error_never_a_crash(tmp_path, name, data):
    (tmp_path / "token").write_text("x" * 32)
    (tmp_path / "token").chmod(0o600)
    valid, loader = LOADERS[name]
    text = dumps_toml(mutate(valid, data))
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return
    load_or_config_error(loader, tmp_path / name, text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_any_text_as_a_config_file_is_a_config_error_or_a_config(tmp_path, text):
    load_or_config_error(mesh_config.load, tmp_path / "mesh.toml", text)
    load_or_config_error(agent_config.load, tmp_path / "agent.toml", text)


def routes(app) -> set[tuple[str, str]]:
    return {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


def described(schema) -> set[tuple[str, str]]:
    def operations(ops: dict) -> dict:  # a path item may be another description's ($ref: "proxy.yaml#/paths/...")
        if "$ref" not in ops:
            return ops
        name, _, pointer = ops["$ref"].partition("#/")
        node = yaml.safe_load((OPENAPI / name).read_text())
        for part in pointer.split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    return {(method, path) for path, ops in schema.raw_schema["paths"].items() for method in operations(ops)}


def test_the_openapi_descriptions_list_exactly_the_routes_the_servers_serve(tmp_path):
    """The fuzzing is only as good as the descriptions: no route undescribed, none described that is gone."""
    (tmp_path / "token").write_text("t" * 32)
    (tmp_path / "token").chmod(0o600)
    (tmp_path / "agent.toml").write_text(dumps_toml(AGENT))
    sup = Supervisor(agent_config.load(tmp_path / "agent.toml"))
    assert routes(make_app(sup, "t" * 32)) == described(agent_schema)

    (tmp_path / "mesh.toml").write_text(dumps_toml(MESH))
    cfg = mesh_config.load(tmp_path / "mesh.toml")
    metrics = Metrics(cfg.name)
    ctl = Controller(cfg, Store(tmp_path / "state" / "meshd.sqlite"), metrics)
    assert routes(control_app(ctl, metrics, "t" * 32)) == described(control_schema)
    assert routes(Proxy(single(cfg), {cfg.name: ctl}, ProxyMetrics(cfg.name)).app()) == described(proxy_schema)
    rank0 = Frontend(SimpleNamespace(eos_token_ids=[0]), Limits("m", 8, 8), generation=1, context_length=64,
                     host="127.0.0.1", port=8100, secret="s" * 32)
    assert routes(rank0.app()) == described(rank_schema)
