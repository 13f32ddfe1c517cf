"""meshd installed from its wheel, not run from a checkout: a fresh venv with
the wheel in it renders the service units (templates and docs are package
data), and packs itself again into a wheel for `meshctl agents install`, which
installs into another fresh venv and runs there."""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed meshd, never a checkout's


def fresh_venv(path: Path) -> Path:
    """A venv without meshd whose other dependencies are this test run's (no index needed)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = next((path / "lib").glob("python3*/site-packages"))
    (site / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path / "bin" / "python"


def pip_install(python: Path, wheel: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        "--force-reinstall", "--no-index", str(wheel)], env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def run_in(python: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def test_an_installed_wheel_renders_its_units_and_packs_itself_for_the_nodes(tmp_path):
    built = tmp_path / "built"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(built), str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = built.glob("meshd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("meshd/share/systemd/meshd.service", "meshd/share/launchd/com.meshd.agent.plist",
                    "meshd/share/docs/AGENT.md", "meshd/share/prometheus/meshd.rules.yml",
                    "meshd/share/grafana/meshd-dashboard.json", "meshd/share/openapi/control.yaml"):
        assert shipped in names

    python = fresh_venv(tmp_path / "venv")
    pip_install(python, wheel)
    work = tmp_path / "work"  # nowhere near the checkout
    work.mkdir()
    (work / "agent.toml").write_text('node = "n"\ntoken_file = "t"\n')
    out = run_in(python, work, "-m", "meshd.meshctl.cli", "service", "install", "agent", "agent.toml", "--system", "linux",
                 "--dest", "out")
    assert out.returncode == 0, out.stdout + out.stderr
    unit = (work / "out" / "meshd-agent.service").read_text()
    docs = next(line for line in unit.splitlines() if line.startswith("Documentation=file://"))
    assert "site-packages/meshd/share/docs" in docs and Path(docs.removeprefix("Documentation=file://")).exists()
    assert f"ExecStart={python} -m agents.server" in unit
    mac = run_in(python, work, "-m", "meshd.meshctl.cli", "service", "install", "agent", "agent.toml", "--system", "macos",
                 "--dest", "out")
    assert mac.returncode == 0 and (work / "out" / "com.meshd.agent.plist").exists(), mac.stderr

    packed = run_in(python, work, "-c", "import sys; from pathlib import Path; from meshd.meshctl.install import build_wheel; "
                                        "print(build_wheel(Path(sys.argv[1])))", str(tmp_path / "packed"))
    assert packed.returncode == 0, packed.stderr
    repacked = Path(packed.stdout.strip())
    inside = set(zipfile.ZipFile(repacked).namelist())
    assert {"meshd/control/controllerd.py", "agents/server.py", "meshd/share/systemd/meshd-agent.service",
            "meshd/dataplane/proxyd.py", "meshd/share/systemd/meshd-proxy.socket", "meshd/share/launchd/com.meshd.proxy.plist",
            "meshd-0.1.0.dist-info/RECORD", "meshd-0.1.0.dist-info/entry_points.txt"} <= inside
    assert not any("__pycache__" in n or n.startswith("..") for n in inside)

    node = fresh_venv(tmp_path / "node-venv")  # what the node's venv gets
    pip_install(node, repacked)
    version = run_in(node, work, "-m", "meshd.meshctl.cli", "--version")
    assert version.returncode == 0 and version.stdout.startswith("meshctl 0.1.0"), version.stdout + version.stderr
    assert all((node.parent / name).exists() for name in ("meshctl", "meshd-agent", "meshd-proxy"))  # entry points
