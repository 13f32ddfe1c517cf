"""mesh.toml mistakes name the key, what was wrong and an example of right."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest

from common.tomlcheck import write_toml
from meshd.meshctl import demo
from meshd.config import ConfigError, gpu_of, hostfile_for, load, parse

ROOT = Path(__file__).resolve().parents[2]

NODE = {"name": "a", "agent": "http://127.0.0.1:7701", "token_file": "t"}
BASE = {"nodes": [NODE], "runtime": {"model": "/m"}}

BAD = [
    ("no nodes", {"runtime": {"model": "/m"}}, "nodes: at least one [[nodes]]"),
    ("node without agent", {**BASE, "nodes": [{"name": "a", "token_file": "t"}]}, "nodes[0].agent: missing"),
    ("agent not a url", {**BASE, "nodes": [{**NODE, "agent": "127.0.0.1:7701"}]}, "nodes[0].agent: expected a URL"),
    ("plain http off loopback", {**BASE, "nodes": [{**NODE, "agent": "http://10.0.0.1:7701"}]},
     "nodes[0].agent: http://10.0.0.1:7701 is plain HTTP off loopback"),
    ("duplicate node", {**BASE, "nodes": [NODE, NODE]}, "the name 'a' is used twice"),
    ("unknown node key", {**BASE, "nodes": [{**NODE, "port": 1}]}, "nodes[0].port: unknown key"),
    ("no model", {"nodes": [NODE]}, "runtime.model: missing"),
    ("bad backend", {**BASE, "backend": "tcp"}, "backend: 'tcp' is not one of"),
    ("ssh timeout a string", {**BASE, "ssh": {"connect_timeout": "5"}}, "ssh.connect_timeout: expected seconds"),
    ("unknown ssh key", {**BASE, "ssh": {"password": "x"}}, "ssh.password: unknown key"),
    ("unknown top key", {**BASE, "nodez": 1}, "nodez: unknown key"),
    ("unknown proxy key", {**BASE, "proxy": {"port": 1}}, "proxy.port: unknown key"),
    ("concurrency string", {**BASE, "proxy": {"concurrency": "8"}}, "proxy.concurrency: expected an integer"),
    ("zero concurrency", {**BASE, "proxy": {"concurrency": 0}}, "proxy.concurrency: must be at least 1"),
    ("no time for headers", {**BASE, "proxy": {"header_timeout": 0}},
     "proxy.header_timeout and proxy.body_timeout must be seconds above 0"),
    ("a negative connection cap", {**BASE, "proxy": {"max_connections": -1}},
     "proxy.max_connections: must not be negative"),
    ("negative wait", {**BASE, "proxy": {"queue_wait": -1}}, "proxy.queue_wait: must not be negative"),
    ("bad listen", {**BASE, "proxy": {"listen": "8000"}}, 'proxy.listen: expected "host:port"'),
    ("bad ladder", {**BASE, "recovery": {"ladder": ["reboot"]}}, 'recovery.ladder: must start with "restart"'),
    ("open proxy off loopback", {**BASE, "proxy": {"listen": "0.0.0.0:8000"}},
     "proxy.listen: 0.0.0.0:8000 is off loopback and proxy.api_keys_file is not set"),
    ("open proxy on a LAN address", {**BASE, "proxy": {"listen": "[fd00::2]:8000"}}, "allow_open = true"),
    ("env not a table", {**BASE, "runtime": {"model": "/m", "env": "X=1"}}, "runtime.env: expected a table"),
]


@pytest.mark.parametrize("name,raw,needle", BAD, ids=[b[0] for b in BAD])
def test_config_mistakes(name, raw, needle, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse(raw, tmp_path)
    assert needle in str(e.value)


def test_a_jaccl_mesh_reads_the_hostfile_meshctl_provision_writes(tmp_path):
    cfg = parse({**BASE, "backend": "jaccl"}, tmp_path)
    assert cfg.hostfile == tmp_path / "state" / "hostfile.json"
    with pytest.raises(ConfigError, match="run `meshctl provision`"):
        hostfile_for(cfg)


def test_ssh_paths_expand_home_and_resolve_beside_the_config(tmp_path):
    cfg = parse({**BASE, "ssh": {"known_hosts": "keys/known_hosts", "key_file": "~/.ssh/id_ed25519"}}, tmp_path)
    assert cfg.ssh.known_hosts == str(tmp_path / "keys" / "known_hosts")
    assert cfg.ssh.key_file == Path("~/.ssh/id_ed25519").expanduser()
    assert parse(BASE, tmp_path).ssh.known_hosts == str(Path("~/.ssh/known_hosts").expanduser())


def test_defaults_listen_on_loopback(tmp_path):
    cfg = parse(BASE, tmp_path)
    assert cfg.proxy.listen.startswith("127.0.0.1:") and cfg.control.listen.startswith("127.0.0.1:")
    assert cfg.recovery.ladder == ("restart",) and cfg.state_dir == tmp_path / "state"


@pytest.mark.parametrize("proxy", [{"listen": "0.0.0.0:8000", "allow_open": True},
                                   {"listen": "0.0.0.0:8000", "api_keys_file": "keys"},
                                   {"listen": "[::1]:8000"}, {"listen": "localhost:8000"}])
def test_a_proxy_is_open_off_loopback_only_when_the_config_says_so(proxy, tmp_path):
    cfg = parse({**BASE, "proxy": proxy}, tmp_path)
    assert cfg.proxy.open_off_loopback == proxy.get("allow_open", False)


def test_meshctl_config_check(tmp_path):
    good = tmp_path / "mesh.toml"
    good.write_text('[[nodes]]\nname = "a"\nagent = "https://h:7701"\ntoken_file = "t"\n[runtime]\nmodel = "/m"\n')
    r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "config", "check", str(good)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "ok (ring mesh 'mesh', 1 nodes" in r.stdout and "warning: nodes.a.token_file" in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nmodel = 3\n")
    r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "config", "check", str(bad)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "nodes: at least one" in r.stderr
    refused = tmp_path / "refused.toml"
    refused.write_text(good.read_text().replace('model = "/m"', 'model = "/m"\nargs = {max_tokns = 9}\n'
                                                                 'env = {LD_PRELOAD = "x"}'))
    r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "config", "check", str(refused)], capture_output=True,
                       text=True)
    assert "warning: runtime.args.max_tokns: not a parameter of the meshd-rank profile" in r.stdout
    assert "warning: runtime.env.LD_PRELOAD: not in the default env_allowlist" in r.stdout
    (tmp_path / "broken.toml").write_text("nodes = [")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load(tmp_path / "broken.toml")


def nccl_mesh(*nodes) -> dict:
    return {**BASE, "backend": "nccl",
            "nodes": [{"name": f"g{i}", "agent": f"http://127.0.0.1:{7701 + i}", "token_file": "t", **n}
                      for i, n in enumerate(nodes)]}


def test_nccl_ranks_on_one_host_get_their_own_gpus_and_two_on_one_gpu_are_refused(tmp_path):
    cfg = parse(nccl_mesh({}, {}, {"address": "10.0.0.2"}), tmp_path)
    assert [gpu_of(cfg.nodes, i) for i in range(3)] == ["0", "1", "0"]
    assert parse(nccl_mesh({"devices": "1"}, {"devices": "0"}), tmp_path).nodes[0].devices == "1"
    with pytest.raises(ConfigError, match=r"nodes.g1.devices: GPU 0 of 127.0.0.1 is g0's too"):
        parse(nccl_mesh({}, {"devices": "0"}), tmp_path)
    with pytest.raises(ConfigError, match="nodes\\[0\\].devices: expected a string"):
        parse(nccl_mesh({"devices": 1}), tmp_path)


def test_every_mistake_is_found_in_one_pass(tmp_path):
    raw = {"nodez": 1, "nodes": [{**NODE, "port": 1}, {"name": "b", "agent": "http://10.0.0.2:7701"}],
           "runtime": {"model": "/m", "port": 99999, "seed": "x"},
           "proxy": {"listen": "127.0.0.1:8001", "concurrency": 0}, "control": {"listen": "127.0.0.1:8001"},
           "recovery": {"ladder": ["reboot"], "windw": 3}}
    with pytest.raises(ConfigError) as e:
        parse(raw, tmp_path)
    for needle in ("nodez: unknown key", "nodes[0].port: unknown key", "nodes[1].token_file: missing",
                   "nodes[1].agent: http://10.0.0.2:7701 is plain HTTP off loopback", "runtime.seed: expected an integer",
                   "proxy.concurrency: must be at least 1", "recovery.windw: unknown key"):
        assert sum(needle in p for p in e.value.problems) == 1, (needle, e.value.problems)
    assert len(e.value.problems) == 7  # a table with a bad key is checked no further (its ranges need its values)


@pytest.mark.parametrize("raw,needle", [
    ({**BASE, "runtime": {"model": "/m", "port": 99999}}, "runtime.port: port 99999 is out of range; use 1-65535"),
    ({**BASE, "runtime": {"model": "/m", "ring_port": 0}}, "runtime.ring_port: port 0 is out of range"),
    ({**BASE, "proxy": {"listen": "127.0.0.1:70000"}}, "proxy.listen: port 70000 is out of range"),
    ({**BASE, "nodes": [{**NODE, "agent": "https://h:123456"}]}, "nodes[0].agent: https://h:123456 has a port out of"),
    ({**BASE, "proxy": {"listen": "127.0.0.1:8001"}}, "control.listen: port 8001 is proxy.listen's too"),
    ({**BASE, "runtime": {"model": "/m", "port": 8000}}, "runtime.port: port 8000 is proxy.listen's too"),
], ids=["rank port", "ring port", "listen port", "agent port", "proxy on control", "rank on proxy"])
def test_ranges_and_listeners_that_collide(raw, needle, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse(raw, tmp_path)


def test_config_check_lists_every_mistake_and_says_it_as_json(tmp_path):
    bad = tmp_path / "mesh.toml"
    bad.write_text('nodez = 1\n[[nodes]]\nname = "a"\nagent = "https://h:7701"\ntoken_file = "t"\n'
                   '[runtime]\nmodel = "/m"\nport = 0\n[proxy]\nconcurrency = 0\n')
    r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "config", "check", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("meshctl: 3 mistakes in the config:\n"), r.stderr
    r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "config", "check", str(bad), "--json"],
                       capture_output=True, text=True)
    report = json.loads(r.stdout)
    assert r.returncode == 1 and not report["ok"] and len(report["problems"]) == 3


def test_the_json_schema_takes_the_configs_meshd_takes_and_refuses_the_mistakes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "config", "schema"], capture_output=True, text=True)
    schema = json.loads(r.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    demo_mesh = tomllib.loads(write_toml(tmp_path / "demo.toml", demo.mesh_config(
        {"proxy": 8000, "control": 8001, "agents": 7701, "rank": 8100, "ring": 32323}, tmp_path / "model",
        demo.DemoOptions())).read_text())
    documented = tomllib.loads(re.search(r"```toml\n(.*?)```", (ROOT / "docs" / "CONFIG.md").read_text(),
                                         re.S).group(1))
    for good in (BASE, demo_mesh, documented):
        parse(good, tmp_path)  # meshd takes it...
        assert not list(validator.iter_errors(good))  # ...and so does the schema
    for bad in ({**BASE, "nodez": 1}, {**BASE, "runtime": {"model": "/m", "port": 0}},
                {**BASE, "proxy": {"concurrency": "8"}}, {"runtime": {"model": "/m"}}):
        assert list(validator.iter_errors(bad)), bad


@pytest.mark.parametrize("runtime,args", [
    ({"model": "/m"}, {}),
    ({"model": "/m", "draft_model": "/d"}, {"draft_model": "/d"}),
    ({"model": "/m", "model_package": "dsv4_overlay"}, {"model_package": "dsv4_overlay"}),
    ({"model": "/m", "model_package": "dsv4_overlay", "args": {"drafter": "off"}},
     {"model_package": "dsv4_overlay", "drafter": "off"}),
    ({"model": "mlx-community/Qwen3-8B-4bit"}, {"model_name": "mlx-community/Qwen3-8B-4bit"}),
    ({"model": "mlx-community/Qwen3-8B-4bit", "args": {"model_name": "qwen"}}, {"model_name": "qwen"}),
], ids=["plain", "draft model", "overlay drafts", "overlay batching", "repo id", "repo id named"])
def test_what_the_ranks_are_started_with(runtime, args, tmp_path):
    assert parse({**BASE, "runtime": runtime}, tmp_path).runtime.launch_args() == args
