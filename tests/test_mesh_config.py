"""mesh.toml mistakes name the key, what was wrong and an example of right."""

import subprocess
import sys
from pathlib import Path

import pytest

from meshd.config import ConfigError, gpu_of, hostfile_for, load, parse

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
    r = subprocess.run([sys.executable, "-m", "meshd.cli", "config", "check", str(good)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "ok (ring mesh 'mesh', 1 nodes" in r.stdout and "warning: nodes.a.token_file" in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nmodel = 3\n")
    r = subprocess.run([sys.executable, "-m", "meshd.cli", "config", "check", str(bad)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "nodes: at least one" in r.stderr
    refused = tmp_path / "refused.toml"
    refused.write_text(good.read_text().replace('model = "/m"', 'model = "/m"\nargs = {max_tokns = 9}\n'
                                                                 'env = {LD_PRELOAD = "x"}'))
    r = subprocess.run([sys.executable, "-m", "meshd.cli", "config", "check", str(refused)], capture_output=True,
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
