"""Metrics for real: promtool on every /metrics, a real Prometheus server
scraping the demo mesh, the Grafana dashboard's queries, and the status page
rendered by headless Chromium, its charts drawn from real traffic and a real
incident (a rank SIGKILLed once, for the whole file)."""

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import requests

from kit.meshctl import Demo, demo_home, demo_meshctl
from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
NODES = 2  # a demo of two: the default four's ranks load twice as long on a small machine
TARGETS = NODES + 2  # every agent, the controller, the proxy
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    home = demo_home(tmp_path_factory, "meshd-home-obs")
    demo_meshctl(home, "up", "--nodes", str(NODES))
    d = Demo(home)
    yield d
    demo_meshctl(home, "down", "--force", check=False)


@pytest.fixture(scope="module")
def recovered(demo):
    """The demo mesh after one of its ranks was SIGKILLed and the next generation serves."""
    before = demo.wait_ready()
    os.kill(demo.rank_pid(NODES - 1), signal.SIGKILL)
    return demo.wait_ready(after=before["generation"])


def metrics_urls(demo) -> list[str]:
    urls = demo.status()["urls"]
    return [urls["metrics"], urls["proxy_metrics"]] + [a["metrics"] for a in urls["agents"].values()]


def test_every_metrics_endpoint_passes_promtool(demo):
    demo.chat()
    for url in metrics_urls(demo):
        text = requests.get(url, timeout=10).text
        r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (url, r.stdout, r.stderr)
        names = set(re.findall(r"^# TYPE (\S+)", text, re.M))
        assert names and all(n.startswith(("meshd_", "process_", "python_")) and ":" not in n for n in names), names
        assert {"meshd_build_info", "process_cpu_seconds_total", "process_resident_memory_bytes"} <= names


def test_alert_rules_check_and_pass_their_unit_tests():
    rules = ROOT / "prometheus"
    r = subprocess.run(["promtool", "check", "rules", str(rules / "meshd.rules.yml")], capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS: 11 rules found" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["promtool", "test", "rules", "meshd.rules.test.yml"], cwd=rules, capture_output=True,
                       text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


@pytest.fixture(scope="module")
def prometheus(demo, tmp_path_factory):
    d = tmp_path_factory.mktemp("prometheus")
    targets = [u.removeprefix("http://").removesuffix("/metrics") for u in metrics_urls(demo)]
    (d / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
        f"  - job_name: meshd-controller\n    static_configs:\n      - targets: ['{targets[0]}']\n"
        f"  - job_name: meshd-proxy\n    static_configs:\n      - targets: ['{targets[1]}']\n"
        "  - job_name: meshd-agent\n    static_configs:\n      - targets: "
        + json.dumps(targets[2:]) + "\n")
    (port,) = free_ports(1)
    proc = subprocess.Popen(["prometheus", f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(d / "prometheus.log", "wb"))
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return requests.get(f"{url}/-/ready", timeout=2).ok
        except requests.RequestException:
            return False

    wait_for(ready, 60, "Prometheus to be ready", interval=0.2)
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


def query(prom: str, expr: str) -> list[dict]:
    r = requests.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", r
    return r["data"]["result"]


def test_a_real_prometheus_scrapes_the_demo_mesh(demo, prometheus, recovered):
    wait_for(lambda: len(query(prometheus, "up == 1")) == TARGETS, 30, "every target up")
    # the mesh was ready again at once; Prometheus says so at its next scrape of the controller
    wait_for(lambda: [float(r["value"][1]) for r in query(prometheus, 'meshd_fleet_state{phase="ready"}')] == [1.0],
             30, "Prometheus to scrape the fleet ready again")
    ranks = query(prometheus, "meshd_agent_rank_up")
    assert sorted(r["metric"]["rank"] for r in ranks) == [str(i) for i in range(NODES)]
    assert len(query(prometheus, "meshd_agent_rank_resident_memory_bytes > 0")) == NODES
    moved = wait_for(lambda: query(prometheus, 'meshd_restarts_total{reason="exit"} > 0'), 30,
                     "the restart counter to move in Prometheus")
    assert float(moved[0]["value"][1]) >= 1
    wait_for(lambda: query(prometheus, "meshd_recovery_seconds_count > 0"), 30, "a recovery time")


def test_processes_report_their_build_and_ranks_their_mlx_memory(demo, prometheus):
    wait_for(lambda: len(query(prometheus, 'meshd_agent_rank_mlx_memory_bytes{kind="active"} > 0')) == NODES, 30,
             "every rank's MLX memory (the loaded weights) in Prometheus")
    assert len(query(prometheus, 'meshd_agent_rank_mlx_memory_bytes{kind="peak"} > 0')) == NODES
    builds = query(prometheus, "meshd_build_info")
    assert sorted(b["metric"]["component"] for b in builds) == ["agent"] * NODES + ["controller", "proxy"]
    assert all(b["metric"]["mlx"] != "not installed" for b in builds)
    assert len(query(prometheus, 'process_cpu_seconds_total{job=~"meshd-.*"}')) == TARGETS
    assert [float(r["value"][1]) for r in query(prometheus, "meshd_desired_up")] == [1.0]
    assert sorted(r["metric"]["node"] for r in query(prometheus, "meshd_agent_up == 1")) == \
        [f"node{i}" for i in range(NODES)]


def test_the_dashboard_queries_only_metrics_that_exist(demo, prometheus):
    dashboard = json.loads((ROOT / "grafana" / "meshd-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    wanted = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\bmeshd_[a-z_]+", e)}
    wait_for(lambda: query(prometheus, "meshd_agent_rank_up"), 30, "a scrape")
    names = requests.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"]
    known = {re.sub(r"_(bucket|sum|count|created)$", "", n) for n in names}
    assert wanted <= known, wanted - known
    for e in exprs:
        r = requests.get(f"{prometheus}/api/v1/query", params={"query": e}, timeout=10).json()
        assert r["status"] == "success", (e, r)


def charted_tokens(page: str) -> int:
    """The completion tokens the page's tokens/s chart accounts for: the sum over its bars' tooltips."""
    return sum(int(n) for n in re.findall(r'<rect class="rate"[^>]*><title>[^<]*: (\d+) tokens in', page))


def incident_steps(page: str) -> list[list[str]]:
    """The steps drawn on each incident's timeline, newest incident first."""
    return [re.findall(r'<g class="step" data-step="([^"]+)"', svg)
            for svg in re.findall(r'<svg class="incident".*?</svg>', page, re.S)]


def test_status_page_draws_tokens_and_the_incident_in_headless_chromium(demo, recovered, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "chromium is installed by .ci/run"
    urls = demo.status()["urls"]
    page = urls["control"] + "/"
    # the tokens served from here on fall between two samples the controller took of the proxy, not in the
    # gap before its first one (it started before the proxy did)
    wait_for(lambda: '<rect class="rate"' in requests.get(page, timeout=10).text, 60,
             "the chart's first interval between two samples of the proxy's counter", interval=0.5)
    before = charted_tokens(requests.get(page, timeout=10).text)
    answer = demo.chat()
    assert answer.status_code == 200, answer.text
    served = answer.json()["usage"]["completion_tokens"]

    def drawn():  # the next sample of the proxy's counter, and the first request the new generation answered
        html = requests.get(page, timeout=10).text
        return charted_tokens(html) == before + served and "served" in incident_steps(html)[0]

    wait_for(drawn, 60, f"the chart to account for the {served} tokens just served, and the incident for its "
                        "first served request", interval=0.5)
    shot = tmp_path / "status.png"  # the page as checked below, in the same run of Chromium
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                          "--window-size=1280,1000", f"--screenshot={shot}", "--dump-dom", page],
                         capture_output=True, text=True, timeout=120).stdout
    for node in (f"node{i}" for i in range(NODES)):
        assert f"<td>{node}</td>" in dom
    assert "ready" in dom and "generation" in dom and "Incidents" in dom
    meshes = requests.get(f"{urls['proxy']}/meshes", timeout=10)
    if meshes.status_code == 200:  # a proxy that fronts meshes lists them, each a row of the page
        names = [m["name"] for m in meshes.json()["meshes"]]
        assert re.findall(r'<tr class="mesh"><td>([^<]*)</td>', dom) == names and names
    else:
        assert "<h2>Meshes</h2>" not in dom
    assert charted_tokens(dom) == before + served
    for label in ("60 min ago", "now", "tokens/s"):
        assert f">{label}</text>" in dom
    newest = demo.incidents()[0]
    assert newest["generation"] == recovered["generation"] - 1
    assert incident_steps(dom)[0] == [s["step"] for s in sorted(newest["timeline"], key=lambda s: s["at"])]
    assert {"detected", "stopped", "started", "loaded", "ready", "served"} <= set(incident_steps(dom)[0])
    assert 'data-stretch="loading"' in dom
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    if os.environ.get("MESHD_WRITE_SCREENSHOT"):
        shutil.copy(shot, ROOT / "docs" / "status-page.png")


def test_the_status_page_reads_its_rates_from_the_proxys_metrics(demo):
    page = demo.status()["urls"]["control"] + "/"
    requests.get(page, timeout=10)  # the page's first sample of the proxy's counters
    with requests.post(f"{demo.proxy}/chat/completions", stream=True, timeout=120,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200 and b"[DONE]" in b"".join(r.iter_content(None))

    def rates_shown() -> bool:  # a look half a second or more after the last one shows the rates between them
        html = requests.get(page, timeout=10).text
        tokens = re.search(r"tokens/s<b>([0-9.]+)</b>", html)
        return bool(tokens and float(tokens.group(1)) > 0 and re.search(r"[0-9.]+ s</b>", html))
    wait_for(rates_shown, 30, "the status page to show the stream's tokens/s and mean time to first token",
             interval=0.2)


def test_status_page_needs_the_token_off_loopback(demo):
    url = demo.status()["urls"]["control"]
    assert requests.get(f"{url}/v1/status", timeout=5).status_code == 401
    assert requests.get(f"{url}/", timeout=5).status_code == 200  # loopback
