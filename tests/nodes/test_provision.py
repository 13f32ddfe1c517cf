"""`meshctl provision` over real SSH (Debian's sshd on loopback, one server
per pretend Mac): host keys verified, the real mlx.distributed_config run
through meshd's SSH settings against stand-ins of the macOS tools, its
hostfile validated and recorded with each node's boot id."""

import asyncio
import json
import subprocess

import paramiko
import pytest

from common.hostfile import validate
from kit.meshctl import another_controller, meshctl
from kit.sshd import keygen, start_fleet
from meshd.nodes import provision
from meshd.config import load
from meshd.meshctl.ports import free_ports
from meshd.nodes.ssh import Session, ssh_config


def write_mesh(path, fleet, backend="jaccl", known_hosts=None, control=None, **ssh):
    known_hosts = known_hosts or fleet.known_hosts(path / "known_hosts")
    lines = [f'name = "tb"\nbackend = "{backend}"\nstate_dir = "state"\n']
    for n in fleet.nodes:
        token = path / f"{n.name}.token"
        token.write_text("x" * 32)
        token.chmod(0o600)
        lines.append(f'[[nodes]]\nname = "{n.name}"\nagent = "http://127.0.0.1:9"\ntoken_file = "{token}"\n'
                     f'ssh = "{n.ssh}"\n')
    settings = {"known_hosts": str(known_hosts), "key_file": str(fleet.client_key), "connect_timeout": 5,
                "command_timeout": 5, **ssh}
    lines.append(f'[control]\nlisten = "{control or f"127.0.0.1:{free_ports(1)[0]}"}"\n')
    lines.append('[runtime]\nmodel = "/models/none"\n[ssh]\n' + "".join(f"{k} = {json.dumps(v)}\n"
                                                                         for k, v in settings.items()))
    mesh = path / "mesh.toml"
    mesh.write_text("\n".join(lines))
    return mesh


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = start_fleet(tmp_path_factory.mktemp("tb"), 4)
    yield f
    f.stop()


@pytest.mark.parametrize("backend", ["jaccl", "jaccl-ring"])
def test_the_real_distributed_config_provisions_through_meshd_ssh(fleet, tmp_path, backend):
    mesh = write_mesh(tmp_path, fleet, backend)
    r = meshctl(mesh, "provision")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "running mlx.distributed_config --hosts node0,node1,node2,node3" in r.stdout
    assert "  | Running auto setup for node0" in r.stdout  # mlx's own output, streamed
    hostfile = json.loads((tmp_path / "state" / "hostfile.json").read_text())
    got_backend, hosts = validate(hostfile)
    assert got_backend == backend and sorted(h["ssh"] for h in hosts) == ["node0", "node1", "node2", "node3"]
    for i, h in enumerate(hosts):
        assert h["ips"] == ["127.0.0.1"] and h["rdma"][i] is None
        if backend == "jaccl":
            assert all(d.startswith("rdma_en") for j, d in enumerate(h["rdma"]) if j != i)
    for n in fleet.nodes:  # auto-setup ran on every node, through sudo, bridge0 first
        commands = (n.state / "commands.log").read_text().splitlines()
        assert "ifconfig bridge0 down" in commands
        assert any(c.startswith("ifconfig en") and " inet 192.168." in c for c in commands), commands
    record = json.loads((tmp_path / "state" / "provisioned.json").read_text())
    assert record["boot_ids"] == {n.name: (n.state / "boot_id").read_text().strip() for n in fleet.nodes}
    if backend == "jaccl-ring":
        return  # the same-boot guard does not depend on the backend

    again = meshctl(mesh, "provision")
    assert again.returncode == 1 and "already ran on node0, node1, node2, node3 in this boot" in again.stderr
    assert "--force" in again.stderr
    forced = meshctl(mesh, "provision", "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr

    # The recovery ladder's reprovision step (what the controller runs): refused within the same boot, so the
    # ladder climbs to reboot; a reboot of any node (shutdown -r: a new boot id) makes auto-setup due again.
    cfg = load(mesh)
    ok, detail = asyncio.run(provision.run_ladder_step(cfg, {}, "reprovision", ()))
    assert not ok and "already ran on node0, node1, node2, node3 in this boot" in detail
    node = fleet.nodes[2]
    subprocess.run(["ssh", "-i", str(fleet.client_key), "-o", f"UserKnownHostsFile={tmp_path / 'known_hosts'}",
                    "-p", str(node.port), "root@127.0.0.1", "sudo -n shutdown -r now"], check=True,
                   capture_output=True)
    ok, detail = asyncio.run(provision.run_ladder_step(cfg, {}, "reprovision", ()))
    assert ok and detail == f"re-provisioned {tmp_path / 'state' / 'hostfile.json'}"


def test_missing_passwordless_sudo_names_the_node_and_the_fix(fleet, tmp_path):
    mesh = write_mesh(tmp_path, fleet)
    fleet.nodes[1].fault("no_sudo")
    try:
        r = meshctl(mesh, "provision")
    finally:
        fleet.nodes[1].fault("no_sudo", on=False)
    assert r.returncode == 1
    assert "node1: auto-setup needs passwordless sudo (sudo: a password is required)" in r.stderr
    assert "sudo visudo" in r.stderr and "NOPASSWD" in r.stderr


def test_an_unknown_host_key_is_refused_with_its_fingerprint_until_pinned(fleet, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    mesh = write_mesh(tmp_path, fleet, "ring", known_hosts=known)
    r = meshctl(mesh, "doctor")
    assert r.returncode == 1
    assert "node0: the host key of [127.0.0.1]:" in r.stdout and "ssh-ed25519 SHA256:" in r.stdout
    assert "--trust-new-host" in r.stdout and known.read_text() == ""
    pinned = meshctl(mesh, "doctor", "--trust-new-host")
    assert "ssh          node0      root@127.0.0.1" in pinned.stdout, pinned.stdout
    assert sorted(known.read_text().splitlines()) == sorted(n.host_key_line() for n in fleet.nodes)
    after = meshctl(mesh, "doctor")  # pinned now: no flag needed
    assert "host key verified" in after.stdout and "is not in" not in after.stdout


def test_a_changed_host_key_is_refused(tmp_path):
    fleet = start_fleet(tmp_path, 1)
    try:
        mesh = write_mesh(tmp_path, fleet, "ring")
        old = fleet.nodes[0].host_key_line()
        fleet.nodes[0].new_host_key()
        r = meshctl(mesh, "doctor", "--trust-new-host")  # pinning new keys never overrides a changed one
        assert "the host key of [127.0.0.1]:" in r.stdout and "CHANGED" in r.stdout
        assert "ssh-keygen -R" in r.stdout
        assert (tmp_path / "known_hosts").read_text().strip() == old
    finally:
        fleet.stop()


def test_an_unreachable_node_fails_fast_naming_it(fleet, tmp_path):

    mesh = write_mesh(tmp_path, fleet, "jaccl")
    text = mesh.read_text().replace(fleet.nodes[3].ssh, f"root@127.0.0.1:{free_ports(1)[0]}")
    mesh.write_text(text)
    r = meshctl(mesh, "provision", timeout=60)
    assert r.returncode == 1 and "node3 (root@127.0.0.1:" in r.stderr and "cannot connect" in r.stderr


def test_a_refused_key_names_the_node_and_authorized_keys(fleet, tmp_path):

    mesh = write_mesh(tmp_path, fleet, "ring", key_file=str(keygen(tmp_path / "stranger")))
    r = meshctl(mesh, "doctor", "--json")
    failed = {c["node"]: c for c in json.loads(r.stdout) if c["name"] == "ssh" and not c["ok"]}
    assert sorted(failed) == ["node0", "node1", "node2", "node3"], r.stdout
    assert "the key was refused" in failed["node0"]["detail"]
    assert "authorized_keys on the node" in failed["node0"]["fix"]


def test_doctor_beside_another_meshs_controller_on_the_control_address(fleet, tmp_path):
    """Two meshes on one machine with the same control address: this one's doctor checks its own nodes
    instead of failing on the other controller's missing token."""
    with another_controller() as address:
        mesh = write_mesh(tmp_path, fleet, "ring", control=address)
        r = meshctl(mesh, "doctor")
    assert "no control token" not in r.stderr, r.stderr
    assert "host key verified" in r.stdout, r.stdout + r.stderr


def test_ssh_follows_the_users_ssh_config_aliases_identity_and_proxyjump(fleet, tmp_path):
    """Nodes named by ~/.ssh/config aliases: HostName, Port, User and IdentityFile come from it, and node1 is
    reached through node0 (ProxyJump), by meshctl's SSH and by OpenSSH with the config meshctl writes."""
    a, b = fleet.nodes[:2]
    user = a.ssh.split("@")[0]
    config = tmp_path / "ssh_config"
    config.write_text(f"Host studio-a\n  HostName 127.0.0.1\n  Port {a.port}\n  User {user}\n"
                      f"  IdentityFile {fleet.client_key}\n"
                      f"Host studio-b\n  HostName 127.0.0.1\n  Port {b.port}\n  IdentityFile {fleet.client_key}\n"
                      f"  ProxyJump studio-a\n")
    mesh = write_mesh(tmp_path, fleet, "ring", config=str(config))
    mesh.write_text(mesh.read_text().replace(f'ssh = "{a.ssh}"', 'ssh = "studio-a"')
                    .replace(f'ssh = "{b.ssh}"', 'ssh = "studio-b"').replace(f'key_file = "{fleet.client_key}"\n', ""))
    cfg = load(mesh)
    assert cfg.ssh.key_file is None  # the key comes from the alias's IdentityFile
    targets = provision.targets(cfg)
    assert (targets[0].host, targets[0].port, targets[0].user) == ("127.0.0.1", a.port, user)
    assert targets[1].jump is not None and targets[1].jump.port == a.port

    with Session(targets[1], cfg.ssh) as s:
        assert isinstance(s.client.get_transport().sock, paramiko.Channel)  # through studio-a's connection
        assert s.run("echo $MESHD_STANDIN_NODE").stdout.strip() == "node1"
    openssh = tmp_path / "openssh_config"
    openssh.write_text(ssh_config(targets[:2], cfg.ssh))
    assert "ProxyJump node1-jump" in openssh.read_text()
    r = subprocess.run(["ssh", "-F", str(openssh), "node1", "echo $MESHD_STANDIN_NODE"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "node1", r.stderr
    doctor = json.loads(meshctl(mesh, "doctor", "--json").stdout)
    assert {c["node"] for c in doctor if c["name"] == "ssh" and c["ok"]} >= {"node0", "node1"}
