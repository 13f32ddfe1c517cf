"""The preflight gate (`meshctl doctor`, and `meshctl up` before it starts a
mesh): every check has a timeout and, when it fails, a one-line fix.

The `judge_*` functions are pure (facts in, checks out) and table-tested;
`gather` collects the facts over SSH and from the agents.
"""

from __future__ import annotations

import asyncio
import math
import re
import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from common.checkpoint import Report
from common.hostfile import HostfileError
from common.modelref import is_repo_id
from common.protocol import EPOCH_MAX, Ballot, RankReport, RankSpec
from common.states import RankState, StopMode
from common.tomlcheck import ConfigError
from meshd.epochs import RESET_PROMISE, Held, Reach, foreign
from meshd.nodes import provision
from meshd.nodes.agentclient import AgentClient, AgentError, agent_session
from meshd.config import MeshConfig, Runtime, hostfile_for
from meshd.nodes.ssh import Session, SshError

USABLE_FRACTION = 0.9  # of iogpu.wired_limit_mb: what a model may take (oMLX caps prefill there too)
LOW_SPACE = 1 << 30  # free bytes in a state directory below which doctor warns (its logs alone rotate to 320 MiB)
JACCL = ("jaccl", "jaccl-ring")


@dataclass(frozen=True)
class Check:
    name: str
    node: str  # a node, or "mesh"
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False  # ok, but an operator should act before it becomes a failure

    def line(self) -> str:
        mark = "FAIL" if not self.ok else "WARN" if self.warn else "ok  "
        told = not self.ok or self.warn
        return f"{mark} {self.name:<12} {self.node:<10} {self.detail}" + (f"\n     fix: {self.fix}" if told else "")


# --- pure judgements ------------------------------------------------------------------

def judge_versions(facts: dict[str, dict]) -> list[Check]:
    """The same Python, mlx and mlx-lm everywhere; the odd ones out are told the majority's versions."""
    keys = ("python", "mlx", "mlx_lm")
    seen = {node: tuple(f.get(k) for k in keys) for node, f in facts.items()}
    if not seen:
        return []
    common, _ = Counter(seen.values()).most_common(1)[0]
    out = []
    for node, v in seen.items():
        label = ", ".join(f"{k} {x}" for k, x in zip(keys, v))
        if v == common:
            out.append(Check("versions", node, True, label))
        else:
            want = dict(zip(keys, common))
            out.append(Check("versions", node, False, f"{label}; the other nodes run "
                             + ", ".join(f"{k} {x}" for k, x in want.items()),
                             f"on {node}: pip install 'mlx=={want['mlx']}' 'mlx-lm=={want['mlx_lm']}' "
                             f"(and Python {want['python']})"))
    return out


def judge_model(facts: dict[str, dict], path: str) -> list[Check]:
    """The model is on every node, and every copy has the same fingerprint."""
    models = {node: f.get("model") or {"present": False} for node, f in facts.items()}
    prints = Counter(m["fingerprint"] for m in models.values() if m.get("present") and m.get("fingerprint"))
    common = prints.most_common(1)[0][0] if prints else None
    repo = is_repo_id(path)
    out = []
    for node, m in models.items():
        if not m.get("present"):
            out.append(Check("model", node, False, f"no model at {path} ({m.get('error') or 'no config.json there'})",
                             f"meshctl model pull {path}" if repo else f"copy it there: rsync -a {path}/ {node}:{path}/"))
        elif hashing := m.get("hashing"):  # not known to differ: a start goes on, the doctor asks again
            out.append(Check("model", node, True, f"{m['bytes'] / 2**30:.2f} GiB in {m['weight_files']} files, its "
                             f"first hash under way: {hashing['done_bytes'] / 2**30:.2f} of "
                             f"{hashing['total_bytes'] / 2**30:.2f} GiB hashed; run meshctl doctor again to compare"))
        elif m["fingerprint"] != common:
            out.append(Check("model", node, False, f"{path} differs from the other nodes' copy "
                             f"(fingerprint {m['fingerprint']} vs {common})",
                             f"meshctl model pull {path} --force" if repo else
                             f"copy it again from a good node: rsync -a --delete GOOD:{path}/ {node}:{path}/"))
        else:
            out.append(Check("model", node, True, f"{m['bytes'] / 2**30:.2f} GiB in {m['weight_files']} files, "
                                                  f"fingerprint {m['fingerprint']}"))
    return out


def judge_checkpoint(facts: dict[str, dict]) -> list[Check]:
    """The checkpoint as each agent read it from its index and headers (common/checkpoint.py): each finding
    once, on the nodes whose copy has it ("mesh" when every copy does), failing when the load would fail;
    whether it drafts with DSpark said once."""
    reports = {node: Report.from_dict(r) for node, f in facts.items()
               if (r := (f.get("model") or {}).get("checkpoint"))}
    seen: dict[str, tuple[Check, list[str]]] = {}
    for node, r in reports.items():
        said = [Check("checkpoint", "", not f.fatal, f"{f.key}: {f.problem}", f.fix, warn=not f.fatal)
                for f in r.findings]
        if d := r.drafting:
            said.append(Check("checkpoint", "", True, d.why if d.dspark else f"serves undrafted: {d.why}", d.fix,
                              warn=not d.dspark))
        for c in said:
            seen.setdefault(c.detail, (c, []))[1].append(node)
    return [replace(c, node="mesh" if len(nodes) == len(reports) else ",".join(nodes)) for c, nodes in seen.values()]


def judge_memory(facts: dict[str, dict], world: int) -> list[Check]:
    """Each rank holds 1/world of the weights; it must fit the node's usable GPU memory: on macOS 90% of
    iogpu.wired_limit_mb when set, elsewhere 90% of the memory available now."""
    out = []
    for node, f in facts.items():
        model = f.get("model") or {}
        if not model.get("present"):
            continue
        share = model["bytes"] / world
        wired = f.get("wired_limit_mb")
        if wired:
            usable, source = USABLE_FRACTION * wired * 2**20, f"90% of iogpu.wired_limit_mb={wired}"
        else:
            usable, source = USABLE_FRACTION * f["memory_available_bytes"], "90% of available memory"
        detail = f"{share / 2**30:.2f} GiB per rank, {usable / 2**30:.2f} GiB usable ({source})"
        if share <= usable:
            out.append(Check("memory", node, True, detail))
            continue
        need_mb = math.ceil(share / USABLE_FRACTION / 2**20)
        total_mb = f.get("memory_total_bytes", 0) // 2**20
        if wired is not None and need_mb <= total_mb:
            fix = (f"on {node}: sudo sysctl iogpu.wired_limit_mb={need_mb} (and wired_limit_mb = {need_mb} in its "
                   f"agent.toml so it holds after a reboot)")
        else:
            fix = f"the model does not fit {world} nodes of this size: use more nodes or a smaller quantization"
        out.append(Check("memory", node, False, f"the model does not fit: {detail}", fix))
    return out


def judge_bridge(node: str, ifconfig_output: str) -> Check:
    flags = re.search(r"flags=\w+<([^>]*)>", ifconfig_output)
    up = bool(flags) and "UP" in flags.group(1).split(",")
    if up:
        return Check("bridge0", node, False, "bridge0 is up: it captures the Thunderbolt ports JACCL needs",
                     f"on {node}: sudo ifconfig bridge0 down (meshctl provision does it)")
    return Check("bridge0", node, True, "down")


def judge_rdma(node: str, devices: str | None, devinfo: str | None, hung: bool) -> Check:
    if hung:
        return Check("rdma", node, False, "ibv_devinfo hung: the RDMA stack is wedged (it happens after a crash)",
                     f"reboot the node: meshctl reboot {node}")
    names = [w for w in (devices or "").split() if w.startswith("rdma_")]
    if not names:
        return Check("rdma", node, False, "no RDMA device (ibv_devices lists none)",
                     "enable RDMA once in macOS Recovery: `rdma_ctl enable`, then reboot")
    states = re.findall(r"state:\s+(\w+)", devinfo or "")
    down = [f"{n}: {s}" for n, s in zip(names, states) if s != "PORT_ACTIVE"]
    if down or not states:
        return Check("rdma", node, False, f"ports not active ({', '.join(down) or 'no port state'})",
                     "check the Thunderbolt cables, then meshctl provision --force")
    return Check("rdma", node, True, f"{len(names)} devices, all PORT_ACTIVE")


def judge_stale(node: str, ranks: list[RankReport], current: int | None) -> Check:
    """No rank left running from a generation that is not the live one."""
    stale = [r for r in ranks if r.state != RankState.EXITED and r.generation != current]
    if stale:
        desc = ", ".join(f"generation {r.generation} rank {r.rank} pid {r.pid}" for r in stale)
        return Check("stale ranks", node, False, desc,
                     f"meshctl down --force, or POST /v1/generations/G/stop on {node}'s agent")
    return Check("stale ranks", node, True, "none")


TWO_CONTROLLERS = ("keep one controller for these nodes: stop the other one on its machine (its service: `sudo "
                   "systemctl stop meshd` or `sudo launchctl bootout system/com.meshd.controller`; else `kill` its "
                   "pid), then `meshctl up` here, whose controller takes the nodes over with a higher epoch. Two "
                   "controllers take the mesh from each other as each starts")


def judge_epoch(node: str, held: Ballot, ours: Ballot | None, running: bool) -> Check:
    """The ballot the agent promised against this mesh's controller's (`ours`: the running one's, else the epoch
    its store last recorded; None when it has taken none), and what a mismatch means."""
    if held.epoch == 0:
        return Check("epoch", node, True, "no controller has taken this node yet")
    if ours is None or held.epoch > ours.epoch or (running and held > ours):
        if running:
            detail = (f"promised {held}, newer than this mesh's running controller ({ours}): another controller "
                      "(another state directory for these nodes) has taken the node over, and this mesh's is "
                      "refused there and stops")
        else:
            detail = (f"promised {held}, " + (f"above this mesh's last controller's (epoch {ours.epoch})" if ours
                      else "and this mesh's controller has taken no epoch yet")
                      + ": a controller of another state directory (another mesh.toml, a restored backup) has "
                        "commanded the node since")
        return Check("epoch", node, True, detail, TWO_CONTROLLERS, warn=True)
    if (held == ours) if running else (held.epoch == ours.epoch):
        return Check("epoch", node, True, f"promised {held}, " + ("the running controller's" if running else
                                                                 "this mesh's last controller's"))
    if not running:
        return Check("epoch", node, True, f"promised {held}; this mesh's next controller takes an epoch above it")
    return Check("epoch", node, True, f"promised {held}, older than the running controller's ({ours}): the agent "
                 "has not promised it yet (it was away during the controller's round, or its state directory was "
                 "wiped)", "nothing while it passes: the controller asks for the promise before its next call to "
                 "the agent; if it stays, the controller cannot reach the agent (`meshctl status` says why)", warn=True)


def judge_promise(node: str, held: Held | str, mesh: str, reach: Reach) -> Check | None:
    """A promise that blocks every start of `mesh`'s controller (`held`: the agent's answer, or why it gave
    none): one it cannot trust, another mesh's, or the highest epoch there is. None: it blocks nothing."""
    if isinstance(held, str):
        return Check("epoch", node, False, held, f"delete the promise file it names on {node}: the agent reads it "
                                                 "again at the next ask")
    if why := foreign(held, mesh, reach):
        return Check("epoch", node, False, f"{why[0]}: this mesh's controller is refused there", why[1])
    if held.ballot.epoch >= EPOCH_MAX:
        return Check("epoch", node, False, f"promised {held.ballot}, the highest epoch there is ({EPOCH_MAX}): "
                                           "no controller can take one above it", RESET_PROMISE)
    return None


def judge_space(node: str, what: str, path: str, free: int | None) -> list[Check]:
    """A state directory with room for its store and logs; a full one is warned of, while it still serves."""
    if free is None:
        return []
    detail = f"{free / 2**20:.0f} MiB free in {path} ({what})"
    if free >= LOW_SPACE:
        return [Check("space", node, True, detail)]
    return [Check("space", node, True, f"only {detail}", f"free space in {path}, or move it to a larger disk (a full "
                  "one loses records and logs; the mesh is still recovered)", warn=True)]


def judge_snapshots(node: str, path: str, used: int | None, free: int | None) -> list[Check]:
    """What the ranks' prefix snapshots take in `path` (in the agent's state directory), warned of when the
    disk has less free than twice that: they could not be written again beside what they hold. Nothing
    while there are none (or the agent does not report them)."""
    if not used:
        return []
    detail = f"{used / 2**20:.0f} MiB in {path}"
    if free is None or free >= 2 * used:
        return [Check("snapshots", node, True, detail + ("" if free is None else f", {free / 2**20:.0f} MiB free"))]
    return [Check("snapshots", node, True, f"{detail}, only {free / 2**20:.0f} MiB free beside them",
                  "lower the ranks' snapshot budget ([runtime] args snapshot_budget_mb in mesh.toml) or free space "
                  "on that disk: a full one stops new snapshots, and the next generation restores fewer prefixes",
                  warn=True)]


def judge_hostfile(cfg: MeshConfig) -> Check:
    try:
        hosts = provision.check_hostfile(hostfile_for(cfg), cfg)
    except (ConfigError, HostfileError) as e:
        return Check("hostfile", "mesh", False, str(e), "meshctl provision")
    return Check("hostfile", "mesh", True, f"{cfg.backend}, {len(hosts)} hosts")


# --- gathering ------------------------------------------------------------------------

def ssh_checks(cfg: MeshConfig, *, trust_new: bool = False, timeout: float = 15) -> list[Check]:
    """SSH reachable with a verified host key; for JACCL also sudo, bridge0 and RDMA. All nodes at once; a
    command that takes longer than `timeout` or [ssh] command_timeout, whichever is shorter, hangs."""
    timeout = min(timeout, cfg.ssh.command_timeout)
    with ThreadPoolExecutor(len(cfg.nodes)) as pool:
        per_node = pool.map(lambda nt: _ssh_node(cfg, *nt, trust_new=trust_new, timeout=timeout),
                            zip(cfg.nodes, provision.targets(cfg)))
        return [c for checks in per_node for c in checks]


def _ssh_node(cfg: MeshConfig, node, target, *, trust_new: bool, timeout: float) -> list[Check]:
    jaccl = cfg.backend in JACCL
    if not node.ssh:
        return [Check("ssh", node.name, False, "no ssh address in mesh.toml; a JACCL mesh is set up over SSH",
                      f'set ssh = "admin@{node.address}" under [[nodes]] name = "{node.name}"')] if jaccl else []
    out = []
    try:
        with Session(target, cfg.ssh, trust_new=trust_new) as s:
            out.append(Check("ssh", node.name, True, f"{target.user}@{target.host}:{target.port}, host key verified"))
            if not jaccl:
                return out
            sudo = s.run("sudo -n true", timeout=timeout)
            out.append(Check("sudo", node.name, sudo.ok, "passwordless" if sudo.ok else sudo.stderr.strip(),
                             provision.sudo_fix(node.name, target.user)))
            out.append(judge_bridge(node.name, s.run("ifconfig bridge0", timeout=timeout).stdout))
            devices = s.run("ibv_devices", timeout=timeout).stdout
            try:
                out.append(judge_rdma(node.name, devices, s.run("ibv_devinfo", timeout=timeout).stdout, False))
            except SshError:
                out.append(judge_rdma(node.name, devices, None, True))
    except SshError as e:
        out.append(Check("ssh", node.name, False, str(e).split("; ")[0], _ssh_fix(str(e))))
    return out


def _ssh_fix(message: str) -> str:
    return message.split("; ", 1)[1] if "; " in message else "check the node's address and sshd"


async def agent_checks(cfg: MeshConfig, current: int | None, controller: Ballot | None = None,
                       running: bool = False) -> list[Check]:
    """Agent reachable and token accepted; versions, model, launch, memory, stale ranks, the epoch it promised
    (against `controller`'s: the running controller's when `running`, else the one its store last recorded) and
    free space from what it reports; and the free space in the controller's own state directory."""
    async with agent_session(cfg) as session:
        clients = {n.name: AgentClient(n, session) for n in cfg.nodes}
        answers = await asyncio.gather(*(_agent_node(clients[n.name], n, cfg, current, controller, running)
                                         for n in cfg.nodes))
    out = [c for checks, _ in answers for c in checks]
    facts = {n.name: f for n, (_, f) in zip(cfg.nodes, answers) if f is not None}
    spaces = [c for node, f in facts.items() for c in
              judge_space(node, "the agent's state directory", f.get("state_dir", "?"), f.get("state_free_bytes"))
              + judge_snapshots(node, f"{f.get('state_dir', '?')}/snapshots", f.get("snapshots_bytes"),
                                f.get("state_free_bytes"))]
    return (out + judge_start(cfg, facts) + judge_memory(facts, len(cfg.nodes)) + spaces
            + judge_space("mesh", "the controller's state directory", str(cfg.state_dir), _free(cfg.state_dir)))


def _free(path) -> int | None:
    """Free bytes where `path` is, or would be made (its nearest existing parent)."""
    for where in (path, *path.parents):
        if where.exists():
            return shutil.disk_usage(where).free
    return None


def judge_start(cfg: MeshConfig, facts: dict[str, dict]) -> list[Check]:
    """The cheap checks every start passes (the controller's too): mistakes no restart can fix."""
    return ([judge_hostfile(cfg)] + judge_versions(facts) + judge_model(facts, cfg.runtime.model)
            + judge_checkpoint(facts) + judge_package(facts, cfg.runtime.model_package)
            + judge_launch(facts, cfg.runtime))


def judge_package(facts: dict[str, dict], name: str) -> list[Check]:
    """The model overlay imports on every node, in one version."""
    if not name:
        return []
    found = {node: f.get("model_package") or {} for node, f in facts.items()}
    versions = Counter(p["version"] for p in found.values() if p.get("present"))
    common = versions.most_common(1)[0][0] if versions else None
    out = []
    for node, p in found.items():
        if not p.get("present"):
            out.append(Check("overlay", node, False, f"model_package {name} does not import on {node} "
                             f"({p.get('error', 'not reported')})", f"on {node}: pip install the package that "
                             f"provides {name} into meshd's venv (~/.meshd/venv)"))
        elif p["version"] != common:
            out.append(Check("overlay", node, False, f"model_package {name} is {p['version']} on {node}; the other "
                             f"nodes have {common}", f"on {node}: install {name} {common}"))
        else:
            out.append(Check("overlay", node, True, f"{name} {p['version']}"))
    return out


def judge_launch(facts: dict[str, dict], runtime: Runtime) -> list[Check]:
    """Each agent allows what the controller will ask it to run: the profile, its parameters, the env names."""
    args = set(runtime.launch_args())
    out = []
    for node, f in facts.items():
        launch = f.get("launch") or {}
        profiles = launch.get("profiles", {})
        if runtime.profile not in profiles:
            out.append(Check("launch", node, False, f"profile {runtime.profile!r} is not allowed by {node}'s agent "
                             f"(it allows {', '.join(sorted(profiles)) or 'none'})",
                             f"set [runtime] profile to one of those, or add [profiles.{runtime.profile}] to "
                             f"{node}'s agent.toml"))
            continue
        bad_args = sorted(args - set(profiles[runtime.profile]))
        bad_env = sorted(set(runtime.env) - set(launch.get("env_allowlist", ())))
        problems = ([f"[runtime] args {bad_args} are not parameters of profile {runtime.profile!r} "
                     f"(it takes {', '.join(profiles[runtime.profile]) or 'none'})"] if bad_args else []) + \
                   ([f"[runtime] env {bad_env} is not in {node}'s env_allowlist"] if bad_env else [])
        if problems:
            out.append(Check("launch", node, False, "; ".join(problems),
                             "remove them from mesh.toml, or allow them in that node's agent.toml "
                             "([profiles.NAME] args, env_allowlist)"))
        else:
            out.append(Check("launch", node, True, f"profile {runtime.profile}, {len(args)} parameters, "
                                                   f"{len(runtime.env)} env names allowed"))
    return out


async def node_facts(cfg: MeshConfig, client: AgentClient) -> dict:
    return await client.node_facts(cfg.runtime.model, cfg.runtime.model_package or None, timeout=30)


async def _agent_node(client: AgentClient, n, cfg: MeshConfig, current: int | None, controller: Ballot | None,
                      running: bool) -> tuple[list[Check], dict | None]:
    try:
        facts = await node_facts(cfg, client)
        ranks = list((await client.ranks()).reports)
    except AgentError as e:
        fix = (f"put the token from {n.name}'s agent config into {n.token_file}" if "401" in str(e) else
               f"start the agent at {n.agent}: `meshctl agents install {n.name}` installs and starts it "
               f"(the demo mesh's agents start with `meshctl up`)")
        return [Check("agent", n.name, False, str(e), fix)], None
    except (OSError, ValueError) as e:  # the token file itself
        return [Check("agent", n.name, False, f"cannot read the token: {e}",
                      f"write {n.name}'s agent token to {n.token_file} (chmod 600)")], None
    try:
        held: Held | str = await client.held()
    except AgentError as e:
        held = str(e)
    blocked = judge_promise(n.name, held, cfg.name, Reach(n.agent, str(n.token_file)))
    return [Check("agent", n.name, True, f"{n.agent}, token accepted"), judge_stale(n.name, ranks, current),
            blocked or judge_epoch(n.name, held.ballot, controller, running)], facts


async def canary(cfg: MeshConfig, hostfile: dict, seconds: float = 3.0, timeout: float = 120) -> list[Check]:
    """all_sum of growing sizes on every node at once (the agents' meshd-canary profile), as generation 0: a
    check per node, its rank's canary line, or what it did instead."""
    async with agent_session(cfg) as session:
        clients = [AgentClient(n, session) for n in cfg.nodes]
        spec = RankSpec(generation=0, rank=0, world=len(cfg.nodes), profile="meshd-canary", model=cfg.runtime.model,
                        hostfile=hostfile, ring_port=cfg.runtime.ring_port, args={"seconds": seconds})
        try:
            await asyncio.gather(*(c.start_rank(replace(spec, rank=i)) for i, c in enumerate(clients)))
            lines = await _canary_lines(clients, time.monotonic() + timeout)
        except AgentError as e:
            return [Check("canary", "mesh", False, f"the canary did not finish: {e}",
                          "the transport is broken: meshctl doctor for the nodes, then meshctl reboot --all")]
        finally:
            await asyncio.gather(*(c.stop_generation(0, StopMode.KILL, 1) for c in clients), return_exceptions=True)
    return [Check("canary", n.name, line.startswith("canary ok"), line,
                  "the transport failed under all_sum: check cables, then meshctl provision --force")
            for n, line in zip(cfg.nodes, lines)]


async def _canary_lines(clients: list[AgentClient], deadline: float) -> list[str]:
    """Each rank's canary line once every rank exited; once one exited without it (its peers then wait for it
    to the end), or at `deadline`, what each rank did instead."""
    while True:
        views = await asyncio.gather(*(c.ranks() for c in clients))
        ranks = [next((r for r in v.reports if r.generation == 0), None) for v in views]
        exited = [r is not None and r.state == RankState.EXITED for r in ranks]
        failed = any(e and (r.exit_code != 0) for e, r in zip(exited, ranks))
        if all(exited) or failed or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.3)
    out = []
    for i, (c, r, e) in enumerate(zip(clients, ranks, exited)):
        log = [line for line in (await c.rank_log(0, i, lines=50))["lines"] if line.strip()]
        said = next((line for line in reversed(log) if line.startswith("canary ")), None)
        last = f"; its last log line: {log[-1]}" if log else "; its log is empty"
        if said is not None:
            out.append(said)
        elif e:
            out.append(f"rank {i} exited {'by signal ' + str(r.exit_signal) if r.exit_signal else r.exit_code} "
                       f"without a canary line{last}")
        else:
            out.append(f"rank {i} had not finished ({r.state if r else 'not started'}) when "
                       f"{'a peer ended without a canary line' if failed else 'the canary timed out'}{last}")
    return out
