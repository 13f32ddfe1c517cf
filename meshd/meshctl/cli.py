"""`meshctl`: up, down, status, restart, apply, events, logs, config check,
provision, doctor, reboot, agents install, service install, proxy restart,
cache clear.

The mesh is the first of: --config (before or after the command),
$MESHD_CONFIG, ./mesh.toml, $XDG_CONFIG_HOME/meshd/mesh.toml (~/.config),
/etc/meshd/mesh.toml; with none of them, the embedded demo mesh: `meshctl up`
starts it (controller, proxy and four agents as background daemons on 127.0.0.1)
and says so, `meshctl down` stops all of it.

Exit codes: 0 done, 1 failed (the message says why and what to do), 2 a
usage error, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import getpass
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

from agents import ringwait
from agents.config import DEFAULT_ENV_ALLOWLIST, DEFAULT_PROFILES
from common.prefills import long_prefills
from common.protocol import Ballot
from common.states import Phase
from common.tomlcheck import ConfigError, listen_host, read_toml, split_listen
from meshd import configdiff
from meshd.meshctl import background, demo, service
from meshd.config import MeshConfig, hostfile_for, load
from meshd.dataplane.proxyconfig import Front, check_twins, is_proxy_config, load_front
from meshd.meshctl.progress import Display
from meshd.seam import FleetRecord
from meshd.store import EPOCH, read_value

# The commands that reach nodes over SSH or the agents' HTTP API import their
# modules when they run: paramiko, aiohttp and structlog would cost every
# meshctl call 0.4 s (python -X importtime: meshd.cli 0.19 s, with
# meshd.doctor 0.61 s).


class CliError(Exception):
    pass


def say(msg: str) -> None:
    print(msg, flush=True)


def caller() -> str:
    """Who runs this meshctl, for the controller's audit trail."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def silent_controller(listen: str, pid: int | None, state: str | None) -> str:
    """What to say of a controller that takes connections (the kernel does, into its backlog) and answers
    none, by the state of its process (`background.process_state`), with the fix."""
    head = f"the controller at {listen} accepts connections but does not answer"
    again = "then `meshctl up` starts one that adopts the running generation"
    if pid is None:
        return (f"{head}, and its process is not one meshctl can see (another user's, or another machine's): "
                "its log says why")
    if state is None:
        return f"{head}: pid {pid} has just exited; {again}"
    if state in background.STOPPED:
        return (f"{head}: pid {pid} is stopped (state T: SIGSTOP, or a debugger holds it). `kill -CONT {pid}` "
                f"resumes it; or `kill -KILL {pid}`, {again}")
    return f"{head}: pid {pid} is {state}, wedged or overloaded (its log says which). `kill {pid}`, {again}"


def timed_out(e: Exception) -> bool:
    """Did the connection go unanswered (urllib raises a timeout bare, or in a URLError while connecting)?"""
    return isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)


class Control:
    def __init__(self, cfg: MeshConfig):
        self.cfg = cfg
        self.base = cfg.control.url
        self._looked = False  # at the controller's process, before the first call

    def _tls(self):
        """Off loopback the control API speaks TLS: trust the mesh CA only (ConfigError when there is none)."""
        return self.cfg.client_tls() if self.cfg.control.tls else None

    def token(self) -> str:
        path = self.cfg.state_dir / "control.token"
        try:
            return path.read_text().strip()
        except PermissionError:
            raise CliError(f"cannot read the control token at {path} (permission denied): run meshctl as the "
                           f"user that runs the controller, or as root")
        except OSError:
            if self.alive():
                raise CliError(self.not_ours())
            raise CliError(f"no control token at {path}: is the controller for {self.cfg.name} running? "
                           f"Start it with `meshd --config {self.cfg.path}` (or `meshctl up`)")

    def not_ours(self) -> str:
        return (f"a controller answers at {self.cfg.control.listen}, but not this mesh's ({self.cfg.name}: no "
                f"control token at {self.cfg.state_dir / 'control.token'}): another mesh's controller holds that "
                f"address; give this mesh another [control] listen")

    def ours(self) -> bool:
        """A controller answers at this mesh's control address and this mesh's token exists (another mesh's
        controller on the same address is not this one's)."""
        return (self.cfg.state_dir / "control.token").exists() and self.alive()

    def _healthz(self) -> bool | None:
        """Does the controller answer /healthz (200, or 503 while its store fails: it still acts)? None: the
        connection was taken and nothing answered within 2 s."""
        try:
            with urllib.request.urlopen(f"{self.base}/healthz", timeout=2, context=self._tls()) as r:
                return r.status == 200
        except urllib.error.HTTPError as e:
            return e.code == 503
        except (OSError, ValueError) as e:  # no mesh CA yet (ConfigError) included: nothing to verify it with
            return None if timed_out(e) else False

    def alive(self) -> bool:
        """Does the controller answer? CliError when its process is stopped."""
        answer = self._healthz()
        if answer is None:
            self.not_stopped(probed=True)
        return bool(answer)

    def process(self) -> tuple[int | None, str | None]:
        """The controller's pid (the one meshctl started for this mesh, else the process listening on its
        address here) and its state."""
        listen = self.cfg.control.listen
        pid = (background.pid_of(run_dir(self.cfg) / "controller.pid")
               or background.listener(listen_host(listen), split_listen("control.listen", listen)[1]))
        return pid, (background.process_state(pid) if pid is not None else None)

    def not_stopped(self, probed: bool = False) -> None:
        """CliError, at once, when the controller's process is stopped: its port accepts connections and
        nothing ever answers. `probed`: /healthz just went unanswered (else it is asked first, so a process
        a debugger pauses for an instant is not called stopped)."""
        pid, state = self.process()
        if state in background.STOPPED and (probed or self._healthz() is None):
            raise CliError(silent_controller(self.cfg.control.listen, pid, state))

    def call(self, method: str, path: str, body=None, timeout: float = 30) -> dict:
        """The controller's JSON answer (urllib, not requests: meshctl starts in a quarter of the time)."""
        if not self._looked:
            self._looked = True
            self.not_stopped()
        req = urllib.request.Request(self.base + path, method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {self.token()}",
                                              "Content-Type": "application/json", "X-Meshd-User": caller()})
        tls = self._tls()
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=tls) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                message = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = f"{e.code}: {text[:200]}"
            raise CliError(message)
        except (OSError, ValueError) as e:
            if timed_out(e):
                raise CliError(silent_controller(self.cfg.control.listen, *self.process()))
            raise CliError(exited_controller(self.cfg) or f"cannot reach the controller at {self.base} "
                           f"({type(e).__name__}); is it running? `meshctl up` starts it")


def exited_controller(cfg: MeshConfig) -> str | None:
    """What the controller meshctl started for this mesh said as it exited (its log's last line: the reason a
    daemon gives as it exits), with its pid and its log's path; None when meshctl started none, or it runs."""
    from common import logfile

    run = run_dir(cfg)
    pid = background.exited(run / "controller.pid")
    if pid is None:
        return None
    log = run / "controller.log"
    found = logfile.tail(log, 1)
    said = found[0][-1] if found and found[0] else "it wrote nothing"
    return f"the controller (pid {pid}) exited: {said} (its log: {log})"


def config_places() -> list[Path]:
    """Where a mesh.toml is looked for after --config and $MESHD_CONFIG, in order."""
    xdg = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return [Path("mesh.toml"), xdg / "meshd" / "mesh.toml", Path("/etc/meshd/mesh.toml")]


def find_config(arg: str | None) -> Path | None:
    """The mesh.toml meshctl drives (None: the demo mesh)."""
    if arg or os.environ.get("MESHD_CONFIG"):
        return Path(arg or os.environ["MESHD_CONFIG"])
    return next((p for p in config_places() if p.is_file()), None)


def front_at(path: Path | None) -> Front | None:
    """The proxy config at `path` (it lists [[meshes]]), or None when it is a mesh.toml or there is none."""
    if path is None or not is_proxy_config(read_toml(path, "pass --config with your mesh.toml")):
        return None
    return load_front(path)


def resolve_config(arg: str | None, *, for_up: bool = False, opts: demo.DemoOptions | None = None) -> MeshConfig:
    path = find_config(arg)
    if path and is_proxy_config(read_toml(path, "pass --config with your mesh.toml")):
        raise CliError(f"{path} is a proxy config (it lists [[meshes]]): `meshctl status` reads it; for this "
                       "command pass one mesh's mesh.toml")
    if path:
        return load(path)
    root = demo.home()
    mesh = root / "mesh.toml"
    if for_up and not demo.any_running(root):
        say(f"no mesh.toml (--config, $MESHD_CONFIG, {', '.join(map(str, config_places()))}): "
            f"this is the embedded demo mesh")
        mesh = demo.write_configs(root, opts or demo.DemoOptions(), lambda m: say(f"demo: {m}"))
    if not mesh.exists():
        raise CliError("no mesh: pass --config mesh.toml, set MESHD_CONFIG, or run `meshctl up` for the demo mesh")
    return load(mesh)


def follow_until_ready(ctl: "Control", timeout: float, after: int = 0) -> dict:
    """Show the mesh moving (live on a terminal) until a generation after `after` serves or the mesh ends
    failed (said, with why); CliError when the time is up."""
    display = Display()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = ctl.call("GET", "/v1/status")
        display.show(status)
        if status["phase"] == "ready" and status["generation"] > after:
            return status
        if status["phase"] == "failed":
            say(f"failed: {status['reason']}")
            return status
        time.sleep(0.3)
    raise CliError(f"not ready after {timeout:.0f}s; `meshctl status` and `meshctl logs NODE` say why")


def run_dir(cfg: MeshConfig) -> Path:
    """Where meshctl keeps the pidfiles and logs of the daemons it starts for this mesh."""
    return demo.run_dir(demo.home()) if cfg.path and demo.is_demo(cfg.path) else cfg.state_dir / "run"


def settled(ctl: Control, pidfile: Path, timeout: float = 60.0) -> str:
    """Wait until the controller answers ("answers") or the process `pidfile` names is gone ("exited");
    "silent" when neither happened within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ctl.alive():
            return "answers"
        if not background.running(pidfile):
            return "exited"
        time.sleep(0.1)
    return "silent"


def start_controller(cfg: MeshConfig, ctl: Control) -> None:
    """The mesh's controller as a daemon (the demo's with its agents), once it answers. One that meshctl
    started before and that does not answer is starting (its API opens once it has adopted what runs) or
    exiting: it is waited for, and replaced once it has exited."""
    run = run_dir(cfg)
    pidfile, log = run / "controller.pid", run / "controller.log"
    if (old := background.pid_of(pidfile)) is not None:
        say(f"the controller meshctl started (pid {old}) does not answer: waiting for it to answer or to exit")
        outcome = settled(ctl, pidfile)
        if outcome == "answers":
            return
        if outcome == "silent":
            raise CliError(f"the controller (pid {old}) neither answers nor exits after 60s; its log ({log}) says "
                           f"why; `kill {old}`, then `meshctl up` starts a new one")
        say(f"{exited_controller(cfg) or f'the controller (pid {old}) exited'}; starting another")
    if cfg.path and demo.is_demo(cfg.path):
        say(f"demo: starting {len(cfg.nodes)} agent{'s' if len(cfg.nodes) > 1 else ''} and the controller on "
            f"127.0.0.1 (logs in {run})")
        if len(cfg.nodes) > 1 and (spins := ringwait.unbuilt()):
            say(f"demo: {spins}")
        demo.start_daemons(demo.home(), cfg.path)
    else:
        say(f"starting the controller for {cfg.name} (log in {log})")
        background.start(background.python_module("meshd.control.controllerd", "--config", str(cfg.path)), pidfile,
                         log)
    outcome = settled(ctl, pidfile)
    if outcome == "exited":
        raise CliError(exited_controller(cfg))
    if outcome == "silent":
        raise CliError(f"the controller did not come up within 60s; see {log}")


def start_or_undo(cfg: MeshConfig, ctl: Control) -> dict:
    """Start the controller (the demo's agents with it) and ask it for the mesh's status. When either fails,
    what this call started is stopped again: a failed `up` leaves no daemon behind (one whose port another
    process took meanwhile, say) for `down` to look for."""
    run = run_dir(cfg)
    before = background.running_in(run)
    try:
        start_controller(cfg, ctl)
        return ctl.call("GET", "/v1/status")
    except (CliError, background.NotStarted) as e:
        started = [f for f, pid in background.running_in(run).items() if before.get(f) != pid]
        background.stop(started)
        undone = f"; `meshctl up` stopped what it had started ({', '.join(f.stem for f in started)})" if started else ""
        again = "; `meshctl up` again picks free ports" if cfg.path and demo.is_demo(cfg.path) else ""
        raise CliError(f"{e}{undone}{again}") from None


def start_proxy(cfg: MeshConfig) -> None:
    """meshd-proxy beside the controller, unless something (a service's, say) already answers there."""
    if background.http_status(f"{cfg.proxy.url}/health") is not None:
        return
    run = run_dir(cfg)
    say(f"starting meshd-proxy on {cfg.proxy.listen} (log in {run / 'proxy.log'})")
    background.start(background.python_module("meshd.dataplane.proxyd", "--config", str(cfg.path), "--pidfile",
                                        str(run / "proxy.pid")), run / "proxy.pid", run / "proxy.log")


def cmd_up(args) -> int:
    opts = demo.DemoOptions(stall_window=args.stall_window, start_deadline=args.start_deadline,
                            max_failures=args.max_failures, backoff_max=args.backoff_max,
                            poison_after=args.poison_after, migration_limit=args.migration_limit,
                            nodes=args.nodes or demo.WORLD)
    cfg = resolve_config(args.config, for_up=True, opts=opts)
    if args.nodes is not None and args.nodes != len(cfg.nodes):
        n = len(cfg.nodes)
        raise CliError(f"the demo mesh runs with {n} node{'s' if n > 1 else ''}: `meshctl down`, then `meshctl up "
                       f"--nodes {args.nodes}`" if cfg.path and demo.is_demo(cfg.path) else
                       f"--nodes is the demo mesh's; {cfg.path} lists this mesh's {n} nodes")
    ctl = Control(cfg)
    if ctl.alive():
        if cfg.path and demo.is_demo(cfg.path):
            revive_demo_agents(cfg.path)
        status = ctl.call("GET", "/v1/status")
    else:
        status = start_or_undo(cfg, ctl)
    if not args.skip_preflight and status["phase"] in ("stopped", "failed"):
        checks = preflight(cfg)
        failed = [c for c in checks if not c.ok]
        if failed:
            for c in failed:
                say(c.line())
            raise CliError(f"preflight: {len(failed)} of {len(checks)} checks fail (fixes above); nothing was "
                           f"started. `meshctl doctor` shows every check; --skip-preflight starts anyway")
        say(f"preflight: {len(checks)} checks pass")
    ctl.call("POST", "/v1/up")
    try:
        start_proxy(cfg)  # once the controller answers as this mesh's
    except background.NotStarted as e:
        raise CliError(f"{e}; the controller starts the mesh meanwhile (`meshctl status`), then `meshctl up` "
                       "starts meshd-proxy")
    status = follow_until_ready(ctl, args.timeout)
    if status["phase"] == "failed":
        return 1
    if down := agents_down(status):
        raise CliError(f"generation {status['generation']} serves, but {', '.join(down)} "
                       f"{'does' if len(down) == 1 else 'do'} not answer: no agent watches or restarts "
                       f"{'its' if len(down) == 1 else 'their'} rank. Start it on its node (`sudo systemctl start "
                       "meshd-agent`; macOS: `sudo launchctl kickstart system/com.meshd.agent`), then `meshctl up`")
    if not background.wait_until(lambda: background.answers(f"{cfg.proxy.url}/health"), 60, 0.2):
        raise CliError(f"the mesh serves but meshd-proxy does not answer on {cfg.proxy.listen}; see "
                       f"{run_dir(cfg) / 'proxy.log'}")
    proxy = status["urls"]["proxy"]
    ranks = len(status["nodes"])
    say(f"\nready: generation {status['generation']} on {ranks} rank{'s' if ranks > 1 else ''}")
    say(f"OpenAI URL: {proxy}")
    say(f"try:  curl -s {proxy}/chat/completions -H 'Content-Type: application/json' "
        "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], \"max_tokens\": 32}'")
    say("stop: meshctl down" + (f" --config {cfg.path}" if args.config else ""))
    return 0


def revive_demo_agents(mesh: Path) -> None:
    """Start again the demo's agents that died under its running controller (CliError when one cannot)."""
    try:
        exited = demo.start_agents(demo.home(), mesh)
    except background.NotStarted as e:
        raise CliError(f"{e}: the demo does not serve without it; `meshctl down`, then `meshctl up`")
    for node, pid in exited.items():
        say(f"demo: {node}'s agent (pid {pid}) had exited; started it again")


def agents_down(status: dict) -> list[str]:
    """The agents the controller does not reach, as `node0's agent (URL: why)`."""
    return [f"{n['node']}'s agent ({n['agent']}: {n.get('error', 'no answer')})" for n in status["nodes"]
            if not n["agent_ok"]]


def may_have_ranks(cfg: MeshConfig) -> bool:
    """Whether ranks of this mesh may run while no controller does: the store's last record of the fleet is
    not `stopped`, or the store is there but cannot be read here (another user's)."""
    fleet = FleetRecord.read(cfg.store_path)
    if fleet is None:
        return cfg.store_path.exists() and not os.access(cfg.store_path, os.R_OK)
    return fleet.phase != Phase.STOPPED


def daemon_words(name: str) -> str:
    """A pidfile's name (`background.stop`) as `meshctl down` says it."""
    if name.startswith("agent-"):
        return f"{name.removeprefix('agent-')}'s agent"
    return {"proxy": "meshd-proxy"}.get(name, f"the {name}")


def stopped_line(daemons: dict[str, int], strays: list[int]) -> str:
    """What `meshctl down` stopped of what `meshctl up` started, in words."""
    words = [f"{daemon_words(name)} (pid {pid})" for name, pid in daemons.items()]
    if strays:
        words.append(f"{len(strays)} rank or standby process{'es' if len(strays) > 1 else ''} that agents left "
                     f"running (pid {', '.join(map(str, strays))})")
    return "stopped " + ", ".join(words) if words else "no process that meshctl started was running"


def cmd_down(args) -> int:
    cfg = resolve_config(args.config)
    ctl = Control(cfg)
    demo_mesh = cfg.path is not None and demo.is_demo(cfg.path)
    run = run_dir(cfg)
    if not ctl.alive() and not demo_mesh and may_have_ranks(cfg):
        # Its ranks may still run (the controller died, or was stopped, under a generation): the controller
        # adopts them as it starts, and stops them below.
        start_controller(cfg, ctl)
    if demo_mesh and ctl.alive() and not background.running(run / "controller.pid"):
        say(f"what answers at {cfg.control.listen} is not the demo's controller (meshctl started none that runs): "
            "nothing to drain")
    elif ctl.alive():
        say("draining" if not args.force else "stopping (force)")
        ctl.call("POST", "/v1/down", {"force": args.force})
        if background.wait_until(lambda: ctl.call("GET", "/v1/status")["phase"] == "stopped", args.timeout, 0.3):
            say("the mesh is stopped")
        elif demo_mesh:  # its ranks are this machine's processes: they are stopped below
            say(f"the mesh did not stop within {args.timeout:.0f}s: stopping its processes")
        else:
            raise CliError(f"the mesh did not stop within {args.timeout:.0f}s; try `meshctl down --force`")
    elif not demo_mesh:
        say(f"no controller runs for {cfg.name} and its store ({cfg.store_path}) records no generation left running: "
            "no rank to stop")
    if demo_mesh:
        stopped = demo.stop_daemons(demo.home())
        say(stopped_line(stopped.daemons, stopped.strays))
        if stopped.left:
            raise CliError(f"processes of the demo are still running: {stopped.left}")
        say("no process of the mesh remains")
        return 0
    say(stopped_line(background.stop(sorted(run.glob("*.pid"))), []))
    if ctl.alive():
        say(f"the controller at {cfg.control.listen} is not one meshctl started (a service's): it goes on running, "
            "its mesh stopped; its service manager stops it (`sudo systemctl stop meshd`; macOS: `sudo launchctl bootout "
            "system/com.meshd.controller`)")
    else:
        say(f"no controller or meshd-proxy that meshctl started for {cfg.name} remains")
    return 0


def cmd_proxy_restart(args) -> int:
    hand_proxy_over(resolve_config(args.config), args.timeout)
    return 0


def hand_proxy_over(cfg: MeshConfig, timeout: float) -> None:
    """Hand meshd-proxy's socket to a new process, which reads mesh.toml as it starts: no connection refused,
    the streams in flight finish on the old one."""
    pidfile = run_dir(cfg) / "proxy.pid"
    old = background.pid_of(pidfile)
    if old is None:
        raise CliError(f"no meshd-proxy that meshctl started runs for {cfg.name} ({pidfile}); a service's is "
                       "restarted by its manager without refusing a connection: `sudo systemctl reload "
                       "meshd-proxy`, or `sudo launchctl kickstart -k system/com.meshd.proxy`")
    os.kill(old, signal.SIGHUP)
    if not background.wait_until(lambda: background.pid_of(pidfile) not in (None, old), timeout, 0.2):
        raise CliError(f"the new meshd-proxy did not take over within {timeout:.0f}s; the old one (pid {old}) "
                       f"goes on serving; see {run_dir(cfg) / 'proxy.log'}")
    say(f"meshd-proxy handed over: pid {old} -> {background.pid_of(pidfile)}; the old one finishes the requests in "
        "flight and exits")


def cmd_apply(args) -> int:
    """Apply an edited mesh.toml: what changed, the next generation started with it when a new generation applies
    it all (and meshd-proxy handed over when it reads a change), else what needs more, with its command."""
    cfg = resolve_config(args.config)  # every mistake in it, before the controller is asked
    ctl = Control(cfg)
    seen = ctl.call("POST", "/v1/apply", {"dry_run": True})
    if cfg.path is not None and Path(seen["config"]).resolve() != cfg.path.resolve():
        say(f"the controller runs {seen['config']}, not {cfg.path}: it reads its own")
    found = [configdiff.Change.from_wire(c) for c in seen["changes"]]
    if not found:
        say(f"nothing changed: generation {seen['generation']} runs {seen['config']} as it is "
            f"(config {seen['digest']})")
        return 0
    for c in found:
        say(c.line())
    for w in default_profile_refusals(cfg):
        say(f"warning: {w}")
    if not seen["applies"]:
        more = [c for c in found if not c.needs.applies]
        raise CliError(f"nothing was applied: {len(more)} of the {len(found)} changes need more than a new "
                       "generation (each with its command above); apply them that way, or undo them and `meshctl "
                       "apply` again")
    now = ctl.call("POST", "/v1/apply")
    before, starts = now["generation"], now["phase"] in ("ready", "starting")  # (what a restart ends)
    say(f"applied: generation {before} ends and the next starts with config {seen['digest']}" if starts else
        f"applied: the mesh is {now['phase']}; its next generation (`meshctl up`) starts with config {seen['digest']}")
    proxy_reads = any(configdiff.proxy_reads(c.key) for c in found)
    if proxy_reads and background.pid_of(run_dir(cfg) / "proxy.pid") is not None:
        hand_proxy_over(cfg, args.timeout)
    elif proxy_reads:
        say("meshd-proxy reads these as it starts, and meshctl started none here: have yours read them with `sudo "
            "systemctl reload meshd-proxy` (macOS: `sudo launchctl kickstart -k system/com.meshd.proxy`)")
    if args.wait and starts:
        status = follow_until_ready(ctl, args.timeout, after=before)
        if status["phase"] == "failed":
            return 1
        say(f"ready: generation {status['generation']} runs config {status['config']['running']}")
    return 0


def meshes_status(front: Front) -> dict:
    """What the proxy says of its meshes (GET /v1/meshes), with each controller's word beside it."""
    url = front.proxy.url
    try:
        with urllib.request.urlopen(f"{url}/v1/meshes", timeout=10) as r:
            seen = {m["name"]: m for m in json.loads(r.read())["meshes"]}
        proxy = "answers"
    except (OSError, ValueError) as e:
        seen, proxy = {}, f"does not answer ({type(e).__name__}): start it with `meshd-proxy --config {front.path}`"
    meshes = []
    for m in front.meshes:
        try:
            st = Control(m.cfg).call("GET", "/v1/status", timeout=10)
            controller = {"phase": st["phase"], "generation": st["generation"], "reason": st["reason"]}
        except CliError as e:
            controller = {"error": str(e)}
        meshes.append({"name": m.name, "config": str(m.cfg.path), **seen.get(m.name, {}), "controller": controller})
    return {"proxy": {"url": url, "state": proxy}, "fallback": front.fallback or None, "meshes": meshes}


def cmd_meshes_status(front: Front, args) -> int:
    status = meshes_status(front)
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    say(f"meshd-proxy {front.name} on {status['proxy']['url']}: {status['proxy']['state']}; "
        f"fallback: {status['fallback'] or 'none'}")
    say(f"{'MESH':<12} {'MODEL':<16} {'CONTROLLER':<22} {'SERVES':<7} {'QUEUE':<6} {'RUNNING':<8} ROUTED")
    for m in status["meshes"]:
        c = m["controller"]
        controller = f"{c['phase']}, generation {c['generation']}" if "phase" in c else "unreachable"
        routed = ", ".join(f"{why} {n}" for why, n in m.get("routed", {}).items()) or "-"
        say(f"{m['name']:<12} {m.get('model', '-'):<16} {controller:<22} "
            f"{('yes' if m['healthy'] else 'no') if 'healthy' in m else '-':<7} {m.get('queue', '-')!s:<6} "
            f"{m.get('in_flight', '-')!s:<8} {routed}")
        if "error" in c:
            say(f"  {m['name']}'s controller: {c['error']}")
    return 0


def cmd_status(args) -> int:
    if (front := front_at(find_config(args.config))) is not None:
        return cmd_meshes_status(front, args)
    cfg = resolve_config(args.config)
    ctl = Control(cfg)
    if args.watch:  # until Ctrl-C
        display = Display()
        try:
            while True:
                display.show(ctl.call("GET", "/v1/status"))
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 0
    status = ctl.call("GET", "/v1/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    say(f"mesh {status['mesh']}: {status['phase']}, generation {status['generation']}"
        + (f" ({status['reason']})" if status["reason"] else ""))
    say(f"{'NODE':<10} {'AGENT':<6} {'RANK':<5} {'STATE':<12} {'LOAD':<8} {'PID':<8} {'RSS MB':<8} UPTIME")
    for n in status["nodes"]:
        r = n["rank"] or {}
        st = r.get("status") or {}
        load = f"{st.get('load_done', 0)}/{st.get('load_total', 0)}" if st else "-"
        uptime = f"{time.time() - r['spawned_at']:.0f}s" if r.get("spawned_at") and r.get("state") != "exited" else "-"
        say(f"{n['node']:<10} {'ok' if n['agent_ok'] else 'DOWN':<6} {r.get('rank', '-')!s:<5} "
            f"{r.get('state', '-'):<12} {load:<8} {r.get('pid', '-')!s:<8} "
            f"{(r.get('rss_bytes') or 0) / 2**20:<8.0f} {uptime}")
    for line in long_prefills(status):
        say(line)
    if "config" in status:  # (a controller of an older meshd says none)
        say(config_line(status, cfg))
    inc = status.get("last_incident")
    if inc:
        back = f"serving again after {inc['recovery_seconds']:.1f}s" if inc["recovery_seconds"] else "not recovered"
        say(f"last incident: {inc['cause']} on {inc['node']} rank {inc['rank']} (generation {inc['generation']}): "
            f"{inc['detail']}; {back}")
    following = status.get("proxies_following", 0)
    say(f"proxy: {status['urls']['proxy']} ("
        + (f"{following} meshd-proxy following the controller" if following else
           "no meshd-proxy follows the controller: `meshctl up` starts one") + ")")
    return 0


def config_line(status: dict, cfg: MeshConfig) -> str:
    """Which config the generation runs and the next one starts with, and whether the mesh.toml here differs."""
    held, edited = status["config"], configdiff.digest(cfg)
    line = f"config: {held['running'] or 'unknown'} (generation {status['generation']})"
    if held["next"] != held["running"]:
        line += f"; the next generation starts with {held['next']}"
    if edited != held["next"]:
        line += f"; {cfg.path} has changed since ({edited}): `meshctl apply` says what and applies it"
    return line


def cmd_restart(args) -> int:
    cfg = resolve_config(args.config)
    ctl = Control(cfg)
    held = ctl.call("GET", "/v1/status").get("config", {}).get("next")
    if held and (edited := configdiff.digest(cfg)) != held:
        say(f"{cfg.path} has changed ({edited}) since the controller read it; the next generation starts with what "
            "the controller holds: `meshctl apply` applies the file")
    before = ctl.call("POST", "/v1/restart")["generation"]
    say("restarting: the generation drains and the next one starts")
    if args.wait:
        status = follow_until_ready(ctl, args.timeout, after=before)
        if status["phase"] == "failed":
            return 1
        say(f"ready: generation {status['generation']}")
    return 0


def cmd_events(args) -> int:
    data = Control(resolve_config(args.config)).call("GET", "/v1/incidents")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for i in data["incidents"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i["opened_at"]))
        back = f"serving after {i['recovery_seconds']:.1f}s via {'+'.join(i['steps'])}" if i["serving_back_at"] \
            else ("failed: " + "+".join(i["steps"]) if "failed" in i["steps"] else "not recovered")
        say(f"{when}  g{i['generation']}  {i['cause']:<10} {i['node']} rank {i['rank']}: {i['detail']}  [{back}]")
        if i["timeline"]:
            say("    " + "  ".join(f"{t['step']} +{t['after']:.2f}s" for t in i["timeline"]))
        for c in i["consequences"]:
            say(f"    then {c}")
        if i["migrated"]:
            say(f"    {i['migrated']} stream(s) it cut resumed on the next generation")
    if not data["incidents"]:
        say("no incidents")
    audit = data["audit"]
    more = f" (the last {AUDIT_SHOWN}; --json has {len(audit)})" if len(audit) > AUDIT_SHOWN else ""
    say(f"control actions, newest first{more}:" if audit else "no control actions")
    for a in audit[:AUDIT_SHOWN]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a["at"]))
        say(f"{when}  {a['action']:<18} {a['outcome']}  by {a['user'] or 'an unnamed caller'} from {a['remote']}")
    return 0


AUDIT_SHOWN = 20
RECENT_INCIDENT = 600.0  # seconds an incident stays what `meshctl logs` shows by default


def log_generation(current: int, incidents: list[dict], now: float, generation: int | None = None,
                   incident: int | None = None) -> tuple[int, str]:
    """Which generation's rank log `meshctl logs` shows, and why: the one asked for (-g), the one of the
    Nth newest incident (--incident N), else the one that died in an incident of the last ten minutes
    (what an operator wants after a crash), else the one serving now."""
    if generation is not None:
        return generation, "asked for"
    if incident is not None:
        if not 1 <= incident <= len(incidents):
            raise CliError(f"--incident {incident}: there are {len(incidents)} incidents (1 is the newest; "
                           f"`meshctl events` lists them)")
        i = incidents[incident - 1]
        return i["generation"], f"incident {incident}: {i['cause']} on {i['node']} rank {i['rank']}"
    if incidents and now - incidents[0]["opened_at"] < RECENT_INCIDENT and incidents[0]["generation"] != current:
        i = incidents[0]
        when = time.strftime("%H:%M:%S", time.localtime(i["opened_at"]))
        return i["generation"], (f"the last incident's, {i['cause']} on {i['node']} rank {i['rank']} at {when}; "
                                 f"-g {current} for the one serving now")
    return current, "serving now"


def cmd_logs(args) -> int:
    ctl = Control(resolve_config(args.config))
    if args.controller:
        path, title = f"/v1/log?lines={args.lines}", "# the controller's log"
    elif not args.node:
        raise CliError("name the node (`meshctl logs node0`), or pass --controller for the controller's own log")
    elif args.agent:
        path, title = f"/v1/logs/{args.node}?source=agent&lines={args.lines}", f"# {args.node}'s agent log"
    else:
        incidents = ctl.call("GET", "/v1/incidents")["incidents"]
        generation, why = log_generation(ctl.call("GET", "/v1/status")["generation"], incidents, time.time(),
                                         args.generation, args.incident)
        path = f"/v1/logs/{args.node}?lines={args.lines}&generation={generation}"
        title = f"# {args.node}'s rank, generation {generation} ({why})"
    data = ctl.call("GET", path)
    if args.json and not args.follow:
        print(json.dumps(data, indent=2))
        return 0
    print(title, file=sys.stderr)
    try:
        while True:
            for line in data["lines"]:
                print(json.dumps({"line": line}) if args.json else line, flush=True)
            if not args.follow:
                return 0
            time.sleep(0.5)
            data = ctl.call("GET", f"{path}&after={data['offset']}")
    except KeyboardInterrupt:
        if args.follow:  # how a follow ends
            return 0
        raise


def cmd_model_pull(args) -> int:
    from meshd.meshctl import modelpull

    try:
        modelpull.pull(resolve_config(args.config), args.repo, source=args.source, force=args.force,
                       trust_new=args.trust_new_host, say=say)
    except modelpull.PullError as e:
        raise CliError(str(e))
    return 0


def cmd_cache_clear(args) -> int:
    from meshd.meshctl import cache

    answers = asyncio.run(cache.clear(resolve_config(args.config)))
    failed = [node for node, a in answers.items() if "error" in a or a["problems"]]
    if args.json:
        print(json.dumps(answers, indent=2))
    else:
        for node, a in answers.items():
            say(f"{node}: {a['error'] if 'error' in a else cache.cleared(a)}")
        done = [a for a in answers.values() if "error" not in a]
        say(f"{sum(a['files'] for a in done)} snapshot files ({cache.mib(sum(a['bytes'] for a in done))}) deleted "
            f"on {len(done)} of {len(answers)} nodes; the ranks serve on (what they hold in memory goes with their "
            "generation: `meshctl restart`)")
    if failed:
        raise CliError(f"snapshots not all cleared on {', '.join(failed)} (why above); `meshctl cache clear` again "
                       "once fixed")
    return 0


def cmd_completion(args) -> int:
    from meshd.meshctl.completion import script

    print(script(build_parser(), args.shell))
    return 0


def cmd_config(args) -> int:
    if args.config_cmd == "nodes":
        for n in resolve_config(args.config).nodes:
            print(n.name)
        return 0
    if args.config_cmd == "schema":
        from meshd.config import json_schema

        print(json.dumps(json_schema(), indent=2))
        return 0
    path = args.file or find_config(args.config)
    if not path:
        raise CliError(f"no mesh.toml in {', '.join(map(str, config_places()))}; name the file: "
                       f"meshctl config check mesh.toml")
    try:
        if (front := front_at(Path(path))) is not None:
            check_twins(front)
        else:
            cfg = load(path)
    except ConfigError as e:
        if not args.json:
            raise
        print(json.dumps({"path": str(path), "ok": False, "problems": e.problems, "warnings": []}, indent=2))
        return 1
    if front is not None:
        meshes = [m.name for m in front.meshes]
        if args.json:
            print(json.dumps({"path": str(path), "ok": True, "problems": [], "warnings": [], "name": front.name,
                              "meshes": meshes, "fallback": front.fallback or None}, indent=2))
        else:
            say(f"{path}: ok (proxy config {front.name!r}, meshes {', '.join(meshes)}, fallback "
                f"{front.fallback or 'none'})")
        return 0
    warnings = [f"nodes.{n.name}.token_file: {n.token_file} does not exist" for n in cfg.nodes
                if not n.token_file.exists()]
    warnings += default_profile_refusals(cfg)
    if args.json:
        print(json.dumps({"path": str(path), "ok": True, "problems": [], "warnings": warnings, "backend": cfg.backend,
                          "name": cfg.name, "nodes": [n.name for n in cfg.nodes], "model": cfg.runtime.model},
                         indent=2))
        return 0
    for m in warnings:
        say(f"warning: {m}")
    say(f"{path}: ok ({cfg.backend} mesh {cfg.name!r}, {len(cfg.nodes)} nodes, model {cfg.runtime.model})")
    return 0


def config_mistakes(e: ConfigError) -> str:
    if len(e.problems) < 2:
        return f"meshctl: {e}"
    return f"meshctl: {len(e.problems)} mistakes in the config:\n" + "\n".join(f"  {p}" for p in e.problems)


def default_profile_refusals(cfg: MeshConfig) -> list[str]:
    """What agents with the default profiles and env allowlist would refuse to launch (`meshctl doctor`
    asks the real agents)."""
    profile = DEFAULT_PROFILES.get(cfg.runtime.profile)
    if profile is None:
        return []
    args = set(cfg.runtime.launch_args())
    fix = "an agent with the default profiles refuses it; remove it, or allow it in every agent.toml"
    return ([f"runtime.args.{a}: not a parameter of the {cfg.runtime.profile} profile (it takes "
             f"{', '.join(sorted(profile['args']))}); {fix}" for a in sorted(args - set(profile["args"]))] +
            [f"runtime.env.{e}: not in the default env_allowlist ({', '.join(DEFAULT_ENV_ALLOWLIST)}); {fix}"
             for e in sorted(set(cfg.runtime.env) - set(DEFAULT_ENV_ALLOWLIST))])


def pick_nodes(cfg: MeshConfig, names: list[str], every: bool) -> tuple[str, ...]:
    """The nodes a command names, or all of them with --all."""
    known = [n.name for n in cfg.nodes]
    chosen = tuple(known) if every else tuple(names)
    unknown = sorted(set(chosen) - set(known))
    if not chosen or unknown:
        raise CliError(f"name the nodes ({', '.join(known)}) or pass --all"
                       + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return chosen


def provision_mesh(cfg: MeshConfig, *, force: bool = False, trust_new: bool = False) -> None:
    from meshd.nodes import provision
    from meshd.nodes.ssh import SshError

    try:
        provision.provision(cfg, force=force, trust_new=trust_new, say=say)
    except (SshError, provision.ProvisionError) as e:
        raise CliError(str(e))


def cmd_provision(args) -> int:
    provision_mesh(resolve_config(args.config), force=args.force, trust_new=args.trust_new_host)
    return 0


def preflight(cfg: MeshConfig, *, canary: bool = False, trust_new: bool = False) -> list:
    from meshd.nodes import doctor

    current, phase, running = None, "stopped", False
    last = read_value(cfg.store_path, EPOCH)
    controller = Ballot(last) if last else None
    ctl = Control(cfg)
    if ctl.ours():
        status = ctl.call("GET", "/v1/status")
        current, phase, running = status["generation"], status["phase"], True
        controller = Ballot(status["epoch"], status["controller_id"])
    checks = doctor.ssh_checks(cfg, trust_new=trust_new)
    checks += asyncio.run(doctor.agent_checks(cfg, current, controller, running))
    if canary and phase not in ("stopped", "failed"):
        checks.append(doctor.Check("canary", "mesh", False, f"the mesh is {phase} (generation {current}): the "
                                   "canary needs the nodes' ranks stopped", "meshctl down, then meshctl doctor --canary"))
    elif canary and all(c.ok for c in checks):
        checks += asyncio.run(doctor.canary(cfg, hostfile_for(cfg)))
    return checks


def cmd_doctor(args) -> int:
    cfg = resolve_config(args.config)
    checks = preflight(cfg, canary=args.canary, trust_new=args.trust_new_host)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            say(c.line())
        failed = [c for c in checks if not c.ok]
        say(f"\n{len(checks) - len(failed)} of {len(checks)} checks pass" + (": ready to start" if not failed else ""))
    return 0 if all(c.ok for c in checks) else 1


def cmd_reboot(args) -> int:
    from meshd.nodes import provision
    from meshd.nodes.agentclient import AgentClient, agent_session

    cfg = resolve_config(args.config)
    nodes = pick_nodes(cfg, args.nodes, args.all)

    async def run():
        async with agent_session(cfg) as session:
            agents = {n.name: AgentClient(n, session) for n in cfg.nodes}
            return await provision.reboot_nodes(cfg, agents, nodes, say, wait=args.wait)

    ok, detail = asyncio.run(run())
    if not ok:
        raise CliError(detail)
    say(detail)
    if cfg.backend in ("jaccl", "jaccl-ring"):
        say("re-provisioning (a reboot loses the Thunderbolt setup)")
        provision_mesh(cfg)
    ctl = Control(cfg)
    if ctl.alive():
        ctl.call("POST", "/v1/up")
        say("handed back to the controller: `meshctl status` shows it starting the mesh")
    return 0


def cmd_agents_install(args) -> int:
    from meshd.meshctl import install

    cfg = resolve_config(args.config)
    try:
        install.install(cfg, list(pick_nodes(cfg, args.nodes, args.all)), say=say, trust_new=args.trust_new_host,
                        system_site_packages=args.system_site_packages, allow_reboot=args.allow_reboot,
                        wired_limit_mb=args.wired_limit_mb, service_dir=args.service_dir)
    except install.InstallError as e:
        raise CliError(str(e))
    return 0


def cmd_service_install(args) -> int:
    system = args.system or ("macos" if sys.platform == "darwin" else "linux")
    files = service.render(args.kind, Path(args.service_config), user=args.user, system=system,
                           wired_limit_mb=args.wired_limit_mb)
    dest = Path(args.dest) if args.dest else service.state_dir_of(args.kind, Path(args.service_config)) / "service"
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (dest / name).write_text(text)
        say(f"wrote {dest / name}")
    say("to enable:")
    for cmd in service.enable_commands(files, dest, system):
        say(f"  {cmd}")
    return 0


def version() -> str:
    from common.buildinfo import versions

    v = {k: s or "not installed" for k, s in versions().items()}
    return f"meshctl {v['meshd']} (mlx {v['mlx']}, mlx-lm {v['mlx_lm']}, Python {v['python']})"


class _Version(argparse.Action):
    """--version, its package lookups done only when asked (meshctl starts fast)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print meshctl's, mlx's and mlx-lm's versions")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        parser.exit()


def config_first(argv: list[str]) -> list[str]:
    """`--config X` anywhere on the line, as git and kubectl take their global options."""
    front, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            front += argv[i:i + 2]
            i += 2
            continue
        (front if argv[i].startswith("--config=") else rest).append(argv[i])
        i += 1
    return front + rest


def demo_nodes(text: str) -> int:
    if text not in map(str, demo.NODES):
        *most, last = map(str, demo.NODES)
        raise argparse.ArgumentTypeError(f"{text!r}: the demo mesh has {', '.join(most)} or {last} nodes (the ways "
                                         "its tiny model divides)")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshctl", description="Drive a meshd mesh (the demo mesh when no config).")
    p.add_argument("--config", help="mesh.toml, before or after the command (default: $MESHD_CONFIG, ./mesh.toml, "
                                    "$XDG_CONFIG_HOME/meshd/mesh.toml, /etc/meshd/mesh.toml, else the demo mesh)")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the mesh (the demo mesh when no config) and wait until it serves")
    up.add_argument("--timeout", type=float, default=900)
    up.add_argument("--skip-preflight", action="store_true", help="start without the doctor's checks")
    up.add_argument("--nodes", type=demo_nodes, metavar="N", help=f"demo: nodes on 127.0.0.1, each an agent and a "
                                                                  f"rank (default {demo.WORLD}; 1: a mesh of one)")
    up.add_argument("--stall-window", type=float, default=10.0, help="demo: agents' stall window, seconds")
    up.add_argument("--start-deadline", type=float, default=120.0, help="demo: seconds to become ready")
    up.add_argument("--max-failures", type=int, default=5, help="demo: failures in the window before failed")
    up.add_argument("--backoff-max", type=float, default=10.0, help="demo: longest wait between restarts")
    up.add_argument("--migration-limit", type=int, default=2,
                    help="demo: how many times a stream cut by a death resumes on the next generation")
    up.add_argument("--poison-after", type=int, default=2,
                    help="demo: a request in flight when this many generations died is quarantined")
    down = sub.add_parser("down", help="drain and stop the mesh (and the demo's daemons)")
    down.add_argument("--force", action="store_true", help="kill instead of draining")
    down.add_argument("--timeout", type=float, default=120)
    st = sub.add_parser("status", help="fleet state and a table of nodes and ranks")
    st.add_argument("--json", action="store_true")
    st.add_argument("-w", "--watch", action="store_true", help="follow it live (load bars, recovery steps) "
                                                               "until Ctrl-C")
    rs = sub.add_parser("restart", help="end this generation and start the next; its streams in flight finish on it "
                                        "first, or resume on the next ([recovery] planned_restart)")
    rs.add_argument("--wait", action="store_true", help="follow the next generation's start until it serves")
    rs.add_argument("--timeout", type=float, default=900)
    ap = sub.add_parser("apply", help="apply an edited mesh.toml: what changed, applied at the next generation (runtime "
                                      "args, drafter, snapshots, limits), or the command that applies it")
    ap.add_argument("--wait", action="store_true", help="follow the next generation's start until it serves")
    ap.add_argument("--timeout", type=float, default=900)
    ev = sub.add_parser("events", help="control actions (who, what, when) and incident history")
    ev.add_argument("--json", action="store_true")
    lg = sub.add_parser("logs", help="a node's rank log tail (the generation of an incident of the last ten "
                                      "minutes, else the one serving), its agent's, or the controller's")
    lg.add_argument("node", nargs="?")
    lg.add_argument("--lines", type=int, default=100)
    which = lg.add_mutually_exclusive_group()
    which.add_argument("-g", "--generation", type=int, help="this generation's log")
    which.add_argument("--incident", type=int, metavar="N", help="the log of the Nth newest incident's generation")
    lg.add_argument("-f", "--follow", action="store_true", help="print lines as they are written, until Ctrl-C")
    which.add_argument("--agent", action="store_true", help="the node's agent's own log, not its rank's")
    which.add_argument("--controller", action="store_true", help="the controller's own log (no node)")
    lg.add_argument("--json", action="store_true", help="the answer as JSON (with -f: a JSON object per line)")
    cfg = sub.add_parser("config", help="config tools")
    cfg_sub = cfg.add_subparsers(dest="config_cmd", required=True)
    check = cfg_sub.add_parser("check", help="validate a mesh.toml: every mistake, in one pass")
    check.add_argument("file", nargs="?")
    check.add_argument("--json", action="store_true")
    cfg_sub.add_parser("schema", help="print a JSON Schema of mesh.toml for editors")
    trust = argparse.ArgumentParser(add_help=False)
    trust.add_argument("--trust-new-host", action="store_true", help="pin host keys not yet in known_hosts")
    prov = sub.add_parser("provision", parents=[trust],
                          help="set the nodes up: JACCL auto-setup over SSH, or a ring hostfile")
    prov.add_argument("--force", action="store_true", help="run auto-setup again within the same boot")
    doc = sub.add_parser("doctor", parents=[trust],
                         help="preflight: every check a mesh needs before it starts, with fixes")
    doc.add_argument("--canary", action="store_true", help="also run all_sum across the mesh (no model)")
    doc.add_argument("--json", action="store_true")
    rb = sub.add_parser("reboot", help="reboot nodes (agent, else SSH), wait for them, re-provision")
    rb.add_argument("nodes", nargs="*")
    rb.add_argument("--all", action="store_true")
    rb.add_argument("--wait", type=float, default=900, help="seconds to wait for a node to come back")
    ag = sub.add_parser("agents", help="node agents")
    ag_sub = ag.add_subparsers(dest="agents_cmd", required=True)
    ai = ag_sub.add_parser("install", parents=[trust],
                           help="over SSH: meshd in a venv, agent config and token, service started")
    ai.add_argument("nodes", nargs="*")
    ai.add_argument("--all", action="store_true")
    ai.add_argument("--system-site-packages", action="store_true",
                    help="let the venv use the node's installed packages (mlx already there)")
    ai.add_argument("--allow-reboot", action="store_true", help="let the agent reboot its node when asked")
    ai.add_argument("--wired-limit-mb", type=int, default=0, help="iogpu.wired_limit_mb the agent applies (macOS)")
    ai.add_argument("--service-dir", help="where the plist/unit goes (default /Library/LaunchDaemons or "
                                          "/etc/systemd/system)")
    svc = sub.add_parser("service", help="service definitions")
    svc_sub = svc.add_subparsers(dest="service_cmd", required=True)
    inst = svc_sub.add_parser("install", help="render the systemd unit / launchd plist for this machine")
    inst.add_argument("kind", choices=["controller", "proxy", "agent"])
    inst.add_argument("service_config", metavar="CONFIG", help="mesh.toml (controller, proxy) or agent.toml (agent)")
    inst.add_argument("--user", help="user the service runs as (default: you)")
    inst.add_argument("--system", choices=["linux", "macos"], help="default: this machine's")
    inst.add_argument("--dest", help="where to write (default: STATE_DIR/service)")
    inst.add_argument("--wired-limit-mb", type=int, help="macOS agent: also render the boot job that sets "
                                                         "iogpu.wired_limit_mb")
    cfg_sub.add_parser("nodes", help="the mesh's node names, one a line (shell completion reads them)")
    px = sub.add_parser("proxy", help="meshd-proxy, the OpenAI endpoint")
    px_sub = px.add_subparsers(dest="proxy_cmd", required=True)
    pr = px_sub.add_parser("restart", help="a new meshd-proxy takes the listening socket over: no connection "
                                           "refused, the streams in flight finish on the old one")
    pr.add_argument("--timeout", type=float, default=90, help="seconds to wait for the new one")
    model = sub.add_parser("model", help="models by Hugging Face id")
    model_sub = model.add_subparsers(dest="model_cmd", required=True)
    mp = model_sub.add_parser("pull", parents=[trust], help="download a repo on one node (its network) and copy it "
                                                            "to the others' Hugging Face caches over SSH")
    mp.add_argument("repo", help="a Hugging Face repo id, e.g. mlx-community/Qwen3-8B-4bit")
    mp.add_argument("--from", dest="source", metavar="NODE", help="the node that downloads (default: the first)")
    mp.add_argument("--force", action="store_true", help="copy every file again, even one already there")
    cache = sub.add_parser("cache", help="the prefix cache's snapshots on the nodes' disks")
    cache_sub = cache.add_subparsers(dest="cache_cmd", required=True)
    clear = cache_sub.add_parser("clear", help="delete every node's prefix snapshots (each agent its own node's); "
                                               "the ranks serve on")
    clear.add_argument("--json", action="store_true")
    comp = sub.add_parser("completion", help="print the shell completion script: "
                                             "`source <(meshctl completion bash)` (or zsh)")
    comp.add_argument("shell", choices=["bash", "zsh"])
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(config_first(sys.argv[1:] if argv is None else argv))
    handlers = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "restart": cmd_restart, "apply": cmd_apply,
                "events": cmd_events, "logs": cmd_logs, "config": cmd_config,
                "service": cmd_service_install, "provision": cmd_provision, "doctor": cmd_doctor,
                "reboot": cmd_reboot, "agents": cmd_agents_install, "completion": cmd_completion,
                "model": cmd_model_pull, "proxy": cmd_proxy_restart, "cache": cmd_cache_clear}
    try:
        return handlers[args.cmd](args)
    except ConfigError as e:
        print(config_mistakes(e), file=sys.stderr)
        return 1
    except CliError as e:
        print(f"meshctl: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `meshctl status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit's flush)
        return 141
    except KeyboardInterrupt:
        print("\nmeshctl: interrupted; what it asked of the controller goes on (`meshctl status` shows it, "
              "`meshctl down` stops it)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
