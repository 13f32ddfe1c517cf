"""Agent config mistakes name the key, the problem and the fix."""

import pytest

from agents.config import DEFAULT_PROFILES, ConfigError, load, parse

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
    ("reboot not bool", {**BASE, "allow_reboot": "yes"}, "allow_reboot: expected true or false"),
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
