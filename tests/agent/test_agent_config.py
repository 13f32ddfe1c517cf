"""Agent config mistakes name the key, the problem and the fix; the agent reads its rank logs back by offset
and keeps only the newest generation directories."""

import asyncio

import pytest

from agents.config import DEFAULT_PROFILES, ConfigError, load, parse
from agents.supervisor import Supervisor
from common import logfile
from common.protocol import RankSpec
from kit.configs import write_agent_config

BASE = {"node": "n", "token_file": "t"}

BAD = [
    ("missing node", {"token_file": "t"}, "node: missing"),
    ("node wrong type", {"node": 3, "token_file": "t"}, "node: expected str"),
    ("listen without port", {**BASE, "listen": "localhost"}, 'listen: expected "host:port"'),
    ("profile without command", {**BASE, "profiles": {"x": {}}}, "profiles.x.command: missing"),
    ("unknown placeholder", {**BASE, "profiles": {"x": {"command": ["{shell}", "{generation}"]}}},
     "unknown placeholder(s) ['shell']"),
    ("no generation marker", {**BASE, "profiles": {"x": {"command": ["python", "{model}"]}}},
     "must carry the generation marker"),
    ("args not flags", {**BASE, "profiles": {"x": {"command": ["{generation}"], "args": {"a": "b"}}}},
     "profiles.x.args"),
    ("unknown stall key", {**BASE, "stall": {"bogus": 1}}, "stall.bogus: unknown key"),
    ("off loopback without TLS", {**BASE, "listen": "0.0.0.0:7701"},
     "listen: 0.0.0.0:7701 is off loopback, where the mesh's token would cross the network in clear"),
    ("half a TLS pair", {**BASE, "tls_cert_file": "agent.pem"}, "tls_cert_file, tls_key_file: set both or neither"),
    ("reboot not bool", {**BASE, "allow_reboot": "yes"}, "allow_reboot: expected true or false"),
    ("standby not bool", {**BASE, "standby": "off"}, "standby: expected true or false"),
]


@pytest.mark.parametrize("name,raw,needle", BAD, ids=[b[0] for b in BAD])
def test_config_errors(name, raw, needle, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse(raw, tmp_path)
    assert needle in str(e.value)


def test_defaults_are_loopback_with_both_builtin_profiles(tmp_path):
    cfg = parse(BASE, tmp_path)
    assert (cfg.host, cfg.port, cfg.allow_reboot) == ("127.0.0.1", 7701, False)
    assert set(cfg.profiles) == set(DEFAULT_PROFILES)


def test_off_loopback_with_a_certificate_and_its_key(tmp_path):
    cfg = parse({**BASE, "listen": "10.0.0.1:7701", "tls_cert_file": "tls/a.pem", "tls_key_file": "tls/a.key"},
                tmp_path)
    assert (cfg.host, cfg.tls.cert, cfg.tls.key) == ("10.0.0.1", tmp_path / "tls/a.pem", tmp_path / "tls/a.key")


def test_token_file_must_be_private_and_long(tmp_path):
    cfg = parse(BASE, tmp_path)
    with pytest.raises(ConfigError, match="cannot read"):
        cfg.token()
    (tmp_path / "t").write_text("x" * 32)
    (tmp_path / "t").chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        cfg.token()
    (tmp_path / "t").chmod(0o600)
    assert cfg.token() == "x" * 32
    (tmp_path / "t").write_text("short")
    with pytest.raises(ConfigError, match="shorter than 16"):
        cfg.token()


def test_invalid_toml_names_the_file(tmp_path):
    (tmp_path / "a.toml").write_text("node = ")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load(tmp_path / "a.toml")


def test_a_rank_log_is_followed_by_offset_through_its_rotation(tmp_path):
    """What `meshctl logs -f` reads: the tail and the live file's size, then the whole lines written after
    it; a file rotated since (shorter than the offset) is read from its start."""
    write_agent_config(tmp_path, "node0", 7701)
    sup = Supervisor(load(tmp_path / "agent.toml"))
    log = sup.state_dir / "gen-3" / "rank-1" / "rank.log"
    log.parent.mkdir(parents=True)
    log.write_text("loading\nready\n")
    assert sup.log_path(3, 1) == log
    lines, offset = logfile.tail(log, 100)
    assert lines == ["loading", "ready"] and offset == len("loading\nready\n")
    with log.open("a") as f:
        f.write("busy\nhalf a li")
    lines, offset = logfile.after(log, offset)
    assert lines == ["busy"]
    assert logfile.after(log, offset) == ([], offset)  # the unfinished line waits for its end
    log.rename(log.with_suffix(".log.1"))
    log.write_text("after rotation\n")
    assert logfile.after(log, offset) == (["after rotation"], len("after rotation\n"))
    assert logfile.tail(log, 3) == (["busy", "half a li", "after rotation"], len("after rotation\n"))
    assert logfile.tail(sup.log_path(9, 1), 10) is None and logfile.after(sup.log_path(9, 1), 0) is None


def test_an_agent_keeps_the_newest_generation_directories(tmp_path):
    """Real ranks (a stand-in that prints a line and exits) of four generations; the agent keeps two."""
    write_agent_config(tmp_path, "node0", 7701, extra={"keep_generations": 2})
    sup = Supervisor(load(tmp_path / "agent.toml"))

    async def run_generations():
        for g in (1, 2, 3, 4):
            rec, _ = await sup.start(RankSpec(generation=g, rank=0, world=1, profile="prints-line", model=str(tmp_path),
                                              hostfile={"backend": "ring", "hosts": [{"ssh": "n", "ips": ["127.0.0.1"]}]},
                                              args={"line": f"generation {g}"}))
            await rec.proc.wait()
            await sup.stop(g, "kill", 1.0)

    asyncio.run(run_generations())
    assert sorted(d.name for d in sup.state_dir.glob("gen-*")) == ["gen-3", "gen-4"]
    assert "generation 4" in (sup.state_dir / "gen-4" / "rank-0" / "rank.log").read_text()
