"""The read-only status page an operator leaves open on a screen: fleet state,
generation, each node's rank with its load progress, live tokens/s and time to
first token, tokens/s over the last hour, each incident's steps on a timeline,
and the proxy's meshes when it fronts several. Server-rendered HTML that
reloads itself every two seconds; no script, no external asset (the drawings
are meshd/control/charts.py's). Its routes (`Page`): the page, open on loopback,
with the control token, or with the cookie its login form sets, and the login."""

from __future__ import annotations

import asyncio
import hmac
import html
import time
from collections import deque
from typing import Callable, Protocol

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from common.errors import ApiError
from common.http import bearer_matches
from common.prefills import long_prefills
from common.secretfile import derive
from common.tomlcheck import loopback
from meshd.control import charts

PHASE_COLOURS = {"ready": "#1f9d55", "starting": "#d69e2e", "recovering": "#dd6b20", "draining": "#718096",
                 "failed": "#e53e3e", "stopped": "#718096"}


async def proxy_samples(session: aiohttp.ClientSession, proxy_url: str) -> dict[str, float]:
    """meshd-proxy's counters ({sample name: value}), read from its /metrics; {} when it does not answer."""
    try:
        async with session.get(f"{proxy_url}/metrics", timeout=aiohttp.ClientTimeout(total=1)) as r:
            text = await r.text() if r.status == 200 else ""
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if not s.labels}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):  # ValueError: not Prometheus text
        return {}


TOKENS = "meshd_proxy_tokens_total"


class TokenHistory:
    """The proxy's token counter every `every` seconds over the last hour, kept in the controller's
    memory only: a restarted controller starts with none."""

    def __init__(self, every: float = 10.0):
        self.every = every
        self.samples: deque[charts.Sample] = deque(maxlen=int(charts.HOUR / every) + 1)

    def note(self, at: float, samples: dict[str, float]) -> None:
        self.samples.append(charts.Sample(at, samples.get(TOKENS)))


async def proxy_meshes(session: aiohttp.ClientSession, proxy_url: str) -> dict | None:
    """meshd-proxy's meshes ({"meshes": [...], "fallback": ...}) from its /v1/meshes; None when it does not
    answer that (a proxy from before it fronted several meshes, or one that is down)."""
    try:
        async with session.get(f"{proxy_url}/v1/meshes", timeout=aiohttp.ClientTimeout(total=1)) as r:
            data = await r.json(content_type=None) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("meshes"), list) else None


def meshes_section(data: dict | None) -> str:
    """A row per mesh the proxy fronts: what it serves, its state, and where the proxy's requests went and
    why; "" when the proxy did not say."""
    if data is None:
        return ""
    e = html.escape
    rows = []
    for m in data["meshes"]:
        m = m if isinstance(m, dict) else {}
        routed = m.get("routed") if isinstance(m.get("routed"), dict) else {}
        phase, healthy = str(m.get("phase", "-")), bool(m.get("healthy"))
        rows.append(f"<tr class='mesh'><td>{e(str(m.get('name', '-')))}</td><td>{e(str(m.get('model', '-')))}</td>"
                    f"<td><code>{e(str(m.get('fingerprint') or '-')[:12])}</code></td>"
                    f"<td><span class='phase' style='background:{PHASE_COLOURS.get(phase, '#718096')}'>{e(phase)}"
                    f"</span></td><td>{e(str(m.get('generation', '-')))}</td>"
                    f"<td class='{'ok' if healthy else 'bad'}'>{'healthy' if healthy else 'NOT HEALTHY'}</td>"
                    f"<td>{e(str(m.get('queue', '-')))}</td><td>{e(str(m.get('in_flight', '-')))}</td>"
                    f"<td>{e(', '.join(f'{why}: {n}' for why, n in routed.items()) or '-')}</td></tr>")
    fallback = data.get("fallback")
    note = (f"<p>fallback model when no mesh of the requested one is up: <b>{e(str(fallback))}</b></p>" if fallback
            else "<p>no fallback model</p>")
    return (f"<h2>Meshes</h2><table class='meshes'><tr><th>mesh</th><th>model</th><th>fingerprint</th><th>phase</th>"
            f"<th>generation</th><th>health</th><th>queue</th><th>in flight</th><th>requests routed here, by reason"
            f"</th></tr>{''.join(rows)}</table>{note}")


class Rates:
    """tokens/s and mean TTFT between two renders, from the proxy's counters."""

    def __init__(self):
        self.last: tuple[float, float, float, float] | None = None
        self.tokens_per_s = 0.0
        self.ttft = None

    def update(self, samples: dict[str, float]) -> None:
        if not samples:  # the proxy did not answer: no rate rather than a wrong one
            self.last, self.tokens_per_s, self.ttft = None, 0.0, None
            return
        now = (time.monotonic(), samples.get("meshd_proxy_tokens_total", 0.0),
               samples.get("meshd_proxy_time_to_first_token_seconds_sum", 0.0),
               samples.get("meshd_proxy_time_to_first_token_seconds_count", 0.0))
        if self.last is None:
            self.last = now
            return
        dt = now[0] - self.last[0]
        if dt >= 0.5:
            self.tokens_per_s = (now[1] - self.last[1]) / dt
            if now[3] > self.last[3]:
                self.ttft = (now[2] - self.last[2]) / (now[3] - self.last[3])
            self.last = now


def prefills_section(status: dict) -> str:
    """The long prefills going on, a line each with its rate and first token expected; "" when none."""
    lines = long_prefills(status)
    if not lines:
        return ""
    return "<h2>Long prefills</h2><ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>"


def _ago(t: float | None) -> str:
    if not t:
        return "-"
    s = time.time() - t
    return f"{s:.0f}s ago" if s < 120 else (f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago")


def login(mesh: str, wrong: bool) -> str:
    """The form a browser off loopback gets instead of the page: the control token, once, for a cookie."""
    note = '<p class="reason">That is not the control token.</p>' if wrong else ""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>meshd {html.escape(mesh)}</title></head>
<body style="font-family: system-ui, sans-serif; margin: 48px;">
<h1>meshd &middot; {html.escape(mesh)}</h1>{note}
<form method="post" action="/login"><label>control token (control.token in the state directory)
<input type="password" name="token" autocomplete="current-password" autofocus></label>
<button type="submit">open the status page</button></form></body></html>"""


def render(status: dict, incidents: list[dict], rates: Rates, history: TokenHistory, meshes: dict | None) -> str:
    e = html.escape
    now = time.time()
    phase = status["phase"]
    rows = []
    for n in status["nodes"]:
        r = n.get("rank") or {}
        st = r.get("status") or {}
        done, total = st.get("load_done", 0), st.get("load_total", 0)
        pct = int(100 * done / total) if total else 0
        state = r.get("state", "-")
        rows.append(
            f"<tr><td>{e(n['node'])}</td><td class='{'ok' if n['agent_ok'] else 'bad'}'>"
            f"{'up' if n['agent_ok'] else 'DOWN'}</td><td>{e(str(r.get('rank', '-')))}</td>"
            f"<td class='state {e(state)}'>{e(state)}</td>"
            f"<td><div class='bar'><div style='width:{pct}%'></div></div> {done}/{total}</td>"
            f"<td>{e(str(r.get('pid', '-')))}</td><td>{(r.get('rss_bytes') or 0) / 2**20:.0f} MB</td>"
            f"<td>{st.get('tokens', 0)}</td></tr>")
    timeline = []
    for n, i in enumerate(incidents[:12]):
        back = (f"serving again after {i['recovery_seconds']:.1f}s" if i["serving_back_at"] else "not recovered")
        recovering = n == 0 and not i["serving_back_at"] and phase in ("recovering", "starting")
        drawing = charts.incident([(s["step"], s["at"]) for s in i["timeline"]], now, recovering)
        timeline.append(f"<li class='incident'><b>{e(time.strftime('%H:%M:%S', time.localtime(i['opened_at'])))}</b> "
                        f"g{i['generation']} <span class='cause'>{e(i['cause'])}</span> on {e(i['node'])} "
                        f"rank {i['rank']}: {e(i['detail'][:160])} &mdash; {e(' → '.join(i['steps']) or '-')}; "
                        f"{e(back)}<br>{drawing}</li>")
    since = (f"since {time.strftime('%H:%M', time.localtime(history.samples[0].at))}" if history.samples
             else "from its start")
    ttft = f"{rates.ttft:.3f} s" if rates.ttft is not None else "-"
    reason = f"<p class='reason'>{e(status['reason'])}</p>" if status.get("reason") else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>meshd: {e(status['mesh'])} {e(phase)}</title>
<style>
body {{ font: 15px -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px; color: #1a202c; background: #f7fafc; }}
h1 {{ font-size: 22px; margin: 0 0 4px; }}
.phase {{ display: inline-block; padding: 2px 10px; border-radius: 10px; color: white; background: {PHASE_COLOURS.get(phase, '#718096')}; }}
.cards {{ display: flex; gap: 16px; margin: 16px 0; }}
.card {{ background: white; border-radius: 8px; padding: 12px 18px; box-shadow: 0 1px 3px #0002; min-width: 140px; }}
.card b {{ display: block; font-size: 24px; }}
table {{ border-collapse: collapse; background: white; box-shadow: 0 1px 3px #0002; border-radius: 8px; }}
td, th {{ padding: 8px 14px; text-align: left; border-bottom: 1px solid #edf2f7; }}
.ok {{ color: #1f9d55; }} .bad {{ color: #e53e3e; font-weight: bold; }}
.state.ready {{ color: #1f9d55; }} .state.busy {{ color: #3182ce; }} .state.loading {{ color: #d69e2e; }}
.bar {{ display: inline-block; width: 90px; height: 8px; background: #edf2f7; border-radius: 4px; vertical-align: middle; }}
.bar div {{ height: 8px; background: #3182ce; border-radius: 4px; }}
.cause {{ color: #dd6b20; font-weight: bold; }} .reason {{ color: #e53e3e; }}
li {{ margin: 4px 0; }} li.incident {{ margin: 10px 0; }}
h2 {{ font-size: 17px; margin: 20px 0 8px; }} svg {{ background: white; border-radius: 6px; }}
.note {{ color: #718096; font-size: 13px; margin: 4px 0 16px; }} ul {{ padding-left: 18px; }}
</style></head><body>
<h1>meshd &middot; {e(status['mesh'])} <span class="phase">{e(phase)}</span></h1>
{reason}
<div class="cards">
<div class="card">generation<b>{status['generation']}</b></div>
<div class="card">ready since<b>{_ago(status.get('ready_since'))}</b></div>
<div class="card">tokens/s<b>{rates.tokens_per_s:.1f}</b></div>
<div class="card">time to first token<b>{ttft}</b></div>
<div class="card">failures in window<b>{status['failures_in_window']}</b></div>
</div>
<table><tr><th>node</th><th>agent</th><th>rank</th><th>state</th><th>load</th><th>pid</th><th>memory</th><th>tokens</th></tr>
{''.join(rows)}
</table>
{prefills_section(status)}
<h2>Tokens/s over the last hour</h2>
{charts.throughput(list(history.samples), now, history.every)}
<p class="note">meshd-proxy's token counter, sampled every {history.every:g} s by this controller {since}; kept in its
memory only, so a restarted controller starts the chart again.</p>
<h2>Incidents</h2>
<ul>{''.join(timeline) or '<li>none</li>'}</ul>
{meshes_section(meshes)}
<p>proxy {e(status['urls']['proxy'])} &middot; updated {time.strftime('%H:%M:%S')}</p>
</body></html>"""


PAGE_COOKIE = "meshd_page"
TOKENS_EVERY = 10.0  # seconds between the page's samples of the proxy's token counter


class PageSource(Protocol):
    """What the page reads of the controller."""

    mesh: str
    tls: bool  # the control API speaks TLS: the cookie goes over it only
    proxy_url: str
    session: aiohttp.ClientSession

    async def status(self) -> dict: ...  # what GET /v1/status says
    def incidents(self, n: int) -> list[dict]: ...  # the newest `n`


Audit = Callable[..., None]


class Page:
    """The page's routes over `source`; `accepted(request, action)` and `refused(request, action, reason)`
    write the audit trail of its logins."""

    def __init__(self, source: PageSource, token: str, accepted: Audit, refused: Audit):
        self.source, self.token = source, token
        self.accepted, self.refused = accepted, refused
        self.cookie = derive(token, "status page cookie")  # opens the page only, never the control API
        self.rates = Rates()
        self.history = TokenHistory(TOKENS_EVERY)

    def allowed(self, request: web.Request) -> bool:
        return (loopback(request.remote) or bearer_matches(request, self.token)
                or hmac.compare_digest(request.cookies.get(PAGE_COOKIE, "").encode(), self.cookie.encode()))

    def login_form(self, wrong: bool) -> web.Response:
        return web.Response(text=login(self.source.mesh, wrong=wrong), status=401, content_type="text/html")

    async def sample_tokens(self) -> None:
        """The proxy's token counter into the history, every `history.every` seconds, for ever."""
        while True:
            self.history.note(time.time(), await proxy_samples(self.source.session, self.source.proxy_url))
            await asyncio.sleep(self.history.every)

    async def page(self, request: web.Request) -> web.Response:
        src = self.source
        samples, meshes = await asyncio.gather(proxy_samples(src.session, src.proxy_url),
                                               proxy_meshes(src.session, src.proxy_url))
        self.rates.update(samples)
        body = render(await src.status(), src.incidents(12), self.rates, self.history, meshes)
        return web.Response(text=body, content_type="text/html")

    async def login(self, request: web.Request) -> web.Response:
        if request.content_type != "application/x-www-form-urlencoded":
            raise ApiError(415, "Send the token as a form field (application/x-www-form-urlencoded), as the "
                                "status page's login form does", code="unsupported_media_type")
        given = (await request.post()).get("token", "")
        if not isinstance(given, str) or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            self.refused(request, "status page login", "wrong token")
            return self.login_form(wrong=True)
        self.accepted(request, "status page login")
        resp = web.Response(status=303, headers={"Location": "/"})
        resp.set_cookie(PAGE_COOKIE, self.cookie, httponly=True, samesite="Strict", secure=self.source.tls,
                        max_age=30 * 86400)
        return resp
