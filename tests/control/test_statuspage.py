"""The status page's drawings, table-tested (data in, SVG out), and its meshes section read from a real
HTTP server that answers /v1/meshes as a proxy in front of several meshes does. The page itself, in a
real browser after real traffic and a real incident, is tests/mesh/test_observability.py's."""

import asyncio
import contextlib
import json
import re

import aiohttp
import pytest
from aiohttp import web

from meshd.control import charts, statuspage
from meshd.control.charts import Interval, Sample
from meshd.meshctl.ports import free_ports

NOW = 1_800_000_000.0


@pytest.mark.parametrize("samples, expected", [
    ([Sample(0, 5), Sample(10, 25)], [Interval(0, 10, 20)]),
    ([Sample(0, 100), Sample(10, 30)], [Interval(0, 10, 30)]),  # a new proxy counted from zero
    ([Sample(0, 5), Sample(10, None), Sample(20, 9)], [Interval(0, 10, None), Interval(10, 20, None)]),
    ([Sample(0, 5), Sample(0, 7), Sample(10, 8)], [Interval(0, 10, 1)]),  # no time between: no interval
    ([Sample(0, 5)], []),
    ([], []),
])
def test_intervals_between_the_counters_samples(samples, expected):
    assert charts.intervals(samples) == expected


@pytest.mark.parametrize("v, ceiling", [(0, 1), (-3, 1), (0.3, 0.5), (1, 1), (1.01, 2), (3.7, 5), (7, 10),
                                        (42, 50), (200, 200), (201, 500)])
def test_nice_ceiling(v, ceiling):
    assert charts.nice_ceiling(v) == pytest.approx(ceiling)


@pytest.mark.parametrize("spans, rows", [
    ([(0, 50), (100, 150), (200, 250)], [0, 0, 0]),
    ([(0, 50), (40, 90), (80, 130), (140, 190)], [0, 1, 0, 0]),
    ([(0, 50), (10, 60), (20, 70), (55, 100), (90, 120)], [0, 1, 2, 3, 0]),
    ([(0, 50), (54, 90)], [0, 1]),  # closer than the gap
])
def test_labels_go_in_the_first_row_they_do_not_overlap(spans, rows):
    assert charts.label_rows(spans) == rows


def bars(svg: str) -> list[tuple[float, str]]:
    """(height, tooltip) of each tokens/s bar."""
    return [(float(h), t) for h, t in re.findall(r'<rect class="rate"[^>]* height="([0-9.]+)"[^>]*><title>([^<]*)',
                                                 svg)]


def test_the_chart_draws_a_bar_per_interval_of_the_last_hour_and_a_band_where_the_proxy_was_away():
    samples = [Sample(NOW - 4000, 0), Sample(NOW - 3590, 100)]  # ends inside the hour: drawn from its left edge
    samples += [Sample(NOW - 600 + 10 * k, 100 + 420 * k) for k in range(30)]  # 42 tokens/s
    samples += [Sample(NOW - 300, None), Sample(NOW - 290, 20_000), Sample(NOW - 280, 20_010)]  # 1 token/s
    svg = charts.throughput(samples, NOW, 10)
    drawn = bars(svg)
    assert len(drawn) == 1 + 1 + 29 + 1  # the old one, the idle one to the first of the 30, 29 among them, the last
    assert svg.count('class="gap"') == 2 and "meshd-proxy did not answer" in svg
    assert ">50</text>" in svg and ">25</text>" in svg and ">0</text>" in svg  # 42 tokens/s under a nice 50
    for label in ("60 min ago", "45 min ago", "30 min ago", "15 min ago", "now", "tokens/s"):
        assert f">{label}</text>" in svg
    heights = {t.split(": ", 1)[1]: h for h, t in drawn}
    for shown, rate in (("420 tokens in 10 s, 42.0 tokens/s", 42), ("10 tokens in 10 s, 1.0 tokens/s", 1)):
        assert heights[shown] == pytest.approx(132 * rate / 50, abs=0.1)  # of the plot's 132 px
    assert heights["0 tokens in 2990 s, 0.0 tokens/s"] == 0


def test_a_chart_with_no_samples_says_when_they_come():
    svg = charts.throughput([Sample(NOW - 3, 0)], NOW, 10)
    assert not bars(svg) and "no samples yet: one every 10 s" in svg
    assert "no samples yet" not in charts.throughput([Sample(NOW - 20, 0), Sample(NOW - 10, 0)], NOW, 10)


RECOVERY = [("detected", NOW), ("stopped", NOW + 0.3), ("swept", NOW + 0.4), ("started", NOW + 0.5),
            ("ready", NOW + 5.2), ("loaded", NOW + 5.0), ("served", NOW + 10)]


def steps_of(svg: str) -> list[str]:
    return re.findall(r'<g class="step" data-step="([^"]+)"', svg)


def stretches_of(svg: str) -> list[str]:
    return re.findall(r'<g class="stretch" data-stretch="([^"]+)"', svg)


@pytest.mark.parametrize("timeline, recovering, steps, stretches", [
    (RECOVERY, False, ["detected", "stopped", "swept", "started", "loaded", "ready", "served"],
     ["stopping", "sweeping", "restarting", "loading", "arming", "first request"]),
    (RECOVERY[:4], True, ["detected", "stopped", "swept", "started"],
     ["stopping", "sweeping", "restarting", "loading"]),
    (RECOVERY[:4], False, ["detected", "stopped", "swept", "started"], ["stopping", "sweeping", "restarting"]),
    ([("planned", NOW), ("stopped", NOW + 2), ("started", NOW + 2.1)], False, ["planned", "stopped", "started"],
     ["draining", "sweeping"]),
    ([("detected", NOW)], False, ["detected"], []),
    ([], False, [], []),
])
def test_an_incidents_timeline_has_a_tick_per_step_and_a_stretch_between_each_two(timeline, recovering, steps,
                                                                                    stretches):
    svg = charts.incident(timeline, NOW + 20, recovering)
    assert steps_of(svg) == steps and stretches_of(svg) == stretches


def test_the_timeline_says_how_long_each_stretch_took_and_since_when():
    svg = charts.incident(RECOVERY, NOW + 20, False)
    assert ">loading 4.50 s</text>" in svg and ">first request 4.80 s</text>" in svg  # wide enough to be written
    assert "stopping 0.30 s (detected → stopped)" in svg  # too narrow: in its tooltip
    assert ">served +10 s</text>" in svg and ">ready +5.20 s</text>" in svg
    xs = [float(x) for x in re.findall(r'<g class="step"[^>]*><line x1="([0-9.]+)"', svg)]
    assert xs == sorted(xs) and xs[0] == 8 and xs[-1] == charts.WIDTH - 8  # in time order, across the width
    recovering = charts.incident(RECOVERY[:4], NOW + 20, True)
    assert "loading 20 s (started → now)" in recovering


def test_the_meshes_section_lists_every_mesh_and_escapes_what_the_proxy_says():
    assert statuspage.meshes_section(None) == ""
    html = statuspage.meshes_section({"meshes": [
        {"name": "<b>east</b>", "model": "tiny", "fingerprint": "0123456789abcdef", "phase": "ready", "generation": 3,
         "healthy": True, "queue": 1, "in_flight": 2, "routed": {"prefix": 4, "queue": 1}},
        {"name": "west", "phase": "recovering", "healthy": False, "routed": "nonsense"}, "not a mesh"],
        "fallback": "small"})
    assert html.count("<tr class='mesh'>") == 3
    assert "&lt;b&gt;east&lt;/b&gt;" in html and "<b>east" not in html
    assert "<code>0123456789ab</code>" in html and "prefix: 4, queue: 1" in html and "NOT HEALTHY" in html
    assert "<b>small</b>" in html


@contextlib.asynccontextmanager
async def answering(path: str, status: int, body: bytes):
    """A real HTTP server on loopback that answers GET `path` with `status` and `body`; yields its URL."""
    async def answer(request):
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get(path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def meshes_read(status: int, body: bytes) -> dict | None:
    async with answering("/v1/meshes", status, body) as url, aiohttp.ClientSession() as session:
        return await statuspage.proxy_meshes(session, url)


async def history_of(*bodies: bytes) -> list[Sample]:
    """The samples a history takes of a proxy whose /metrics answers each of `bodies` in turn."""
    history = statuspage.TokenHistory(10)
    async with aiohttp.ClientSession() as session:
        for at, body in enumerate(bodies):
            async with answering("/metrics", 200, body) as url:
                history.note(NOW + 10 * at, await statuspage.proxy_samples(session, url))
    return list(history.samples)


def test_the_history_samples_the_proxys_token_counter_and_marks_what_it_could_not_read():
    counter = b"# TYPE meshd_proxy_tokens_total counter\nmeshd_proxy_tokens_total %d\n"
    samples = asyncio.run(history_of(counter % 7, b"this { is not Prometheus text", counter % 19))
    assert samples == [Sample(NOW, 7), Sample(NOW + 10, None), Sample(NOW + 20, 19)]
    history = statuspage.TokenHistory(10)
    for k in range(400):
        history.note(NOW + 10 * k, {})
    assert len(history.samples) == 361 and history.samples[0].at == NOW + 390  # an hour's worth, the newest


async def meshes_from_nowhere() -> dict | None:
    async with aiohttp.ClientSession() as session:
        return await statuspage.proxy_meshes(session, f"http://127.0.0.1:{free_ports(1)[0]}")


TWO_MESHES = {"meshes": [{"name": n, "model": "tiny", "fingerprint": "f" * 64, "phase": "ready", "generation": g,
                          "healthy": True, "queue": 0, "in_flight": 0, "routed": {"model": g}}
                         for n, g in (("east", 2), ("west", 5))], "fallback": None}


def test_the_page_lists_the_meshes_a_real_proxy_answers_and_leaves_them_out_when_it_does_not():
    status = {"phase": "ready", "mesh": "demo", "nodes": [], "generation": 1, "failures_in_window": 0,
              "urls": {"proxy": "http://127.0.0.1:1/v1"}}

    def page(meshes) -> str:
        return statuspage.render(status, [], statuspage.Rates(), statuspage.TokenHistory(), meshes)

    meshes = asyncio.run(meshes_read(200, json.dumps(TWO_MESHES).encode()))
    assert meshes == TWO_MESHES
    shown = page(meshes)
    assert "<h2>Meshes</h2>" in shown and shown.count("<tr class='mesh'>") == 2
    assert "<td>east</td>" in shown and "<td>west</td>" in shown and "no fallback model" in shown
    for answer in ((404, b'{"error": {"message": "no such route"}}'), (200, b"not json"), (200, b'{"meshes": "none"}'),
                   (200, b"[]")):
        assert asyncio.run(meshes_read(*answer)) is None, answer
    assert asyncio.run(meshes_from_nowhere()) is None
    assert "Meshes" not in page(None)
