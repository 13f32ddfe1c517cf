#!/usr/bin/env python3
"""Stand-ins for the macOS tools meshd and mlx.distributed_config run on a
node over SSH, printing what the real tools print (Linux has none of them).
Each tool is a symlink to this file; which node it plays comes from
MESHD_STANDIN_NODE (node0..node3, set by the node's sshd), and its state
(boot id, wired limit, interfaces, faults to play) lives under
$MESHD_STANDIN_STATE/<node>/. Files there that switch on a fault:
no_sudo, ibv_hang, ibv_down, bridge_up."""

import json
import os
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODE = os.environ.get("MESHD_STANDIN_NODE", "node0")
INDEX = int(NODE.removeprefix("node") or 0)
STATE = Path(os.environ.get("MESHD_STANDIN_STATE", "/tmp/meshd-standins")) / NODE
PORTS = 6


def state(name: str, default: str | None = None) -> str | None:
    path = STATE / name
    return path.read_text().strip() if path.exists() else default


def put(name: str, value: str) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / name).write_text(value + "\n")


def log_command() -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    with (STATE / "commands.log").open("a") as f:
        f.write(" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) + "\n")


def thunderbolt() -> dict:
    return json.loads((HERE / "data" / f"thunderbolt-{NODE}.json").read_text())


def connected_ifaces() -> list[str]:
    return [f"en{int(t['receptacle_1_tag']['receptacle_id_key']) + 1}" for t in thunderbolt()["SPThunderboltDataType"]
            if t.get("_items")]


def system_profiler(args):
    if args[:1] != ["SPThunderboltDataType"]:
        sys.exit(f"standin system_profiler: only SPThunderboltDataType is recorded, got {args}")
    print(json.dumps(thunderbolt(), indent=2))


def networksetup(args):
    if args != ["-listallhardwareports"]:
        sys.exit(f"standin networksetup: unsupported {args}")
    ports = [("Ethernet", "en0"), ("Wi-Fi", "en1"), ("Thunderbolt Bridge", "bridge0")]
    ports += [(f"Thunderbolt {p}", f"en{p + 1}") for p in range(1, PORTS + 1)]
    print()
    for k, (name, dev) in enumerate(ports):
        mac = ":".join(f"{b:02x}" for b in (0x36, 0x5A, 0x11, INDEX, 0x00, k))
        print(f"Hardware Port: {name}\nDevice: {dev}\nEthernet Address: {mac}\n")
    print("VLAN Configurations\n===================")


def ipconfig(args):
    if args[:1] == ["getifaddr"] and args[1:] == ["en0"]:
        print("127.0.0.1")
    else:
        sys.exit(1)


def ibv_devices(args):
    print(f"    {'device':<24}node GUID")
    print(f"    {'------':<24}----------------")
    for iface in connected_ifaces():
        print(f"    {'rdma_' + iface:<24}{0:016x}")


def ibv_devinfo(args):
    if (STATE / "ibv_hang").exists():
        time.sleep(3600)
    port_state = "PORT_DOWN (1)" if (STATE / "ibv_down").exists() else "PORT_ACTIVE (4)"
    for iface in connected_ifaces():
        print(f"hca_id:\trdma_{iface}\n\ttransport:\t\t\tInfiniBand (0)\n\tfw_ver:\t\t\t\t0.0.0\n"
              f"\tvendor_id:\t\t\t0x05ac\n\tphys_port_cnt:\t\t\t1\n\t\tport:\t1\n"
              f"\t\t\tstate:\t\t\t{port_state}\n\t\t\tmax_mtu:\t\t4096 (5)\n\t\t\tactive_mtu:\t\t4096 (5)\n")


def ifconfig(args):
    log_command()
    if args == ["bridge0", "down"]:
        put("bridge0", "down")
    elif args == ["bridge0"]:
        up = state("bridge0", "up") == "up"
        print(f"bridge0: flags={'8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST>' if up else '8822<BROADCAST,SMART,SIMPLEX,MULTICAST>'} mtu 1500")
        print(f"\tstatus: {'active' if up else 'inactive'}")


def route(args):
    log_command()


def sudo(args):
    if (STATE / "no_sudo").exists():
        print("sudo: a password is required", file=sys.stderr)
        sys.exit(1)
    args = [a for a in args if a != "-n"]
    if args:
        os.execvp(args[0], args)


def boot_id() -> str:
    value = state("boot_id")
    if value is None:
        value = str(uuid.uuid4()).upper()
        put("boot_id", value)
    return value


def sysctl(args):
    if args and args[0] == "-n":
        args = args[1:]
        prefix = ""
    else:
        prefix = None
    for arg in args:
        key, _, value = arg.partition("=")
        if value:
            old = state(key, "0")
            put(key, value)
            print(f"{key}: {old} -> {value}")
            continue
        known = {"kern.bootsessionuuid": boot_id(), "iogpu.wired_limit_mb": state("iogpu.wired_limit_mb", "0"),
                 "hw.memsize": str(192 << 30)}
        if key not in known:
            print(f"sysctl: unknown oid '{key}'", file=sys.stderr)
            sys.exit(1)
        print(known[key] if prefix == "" else f"{key}: {known[key]}")


def shutdown(args):
    log_command()
    if "-r" not in args:
        sys.exit("standin shutdown: only -r (reboot) is played")
    put("boot_id", str(uuid.uuid4()).upper())
    print(f"Shutdown at {time.strftime('%a %b %d %H:%M:%S %Z %Y')}.\nshutdown: [pid {os.getpid()}]")


def uname(args):
    print({"-s": "Darwin", "-m": "arm64", "-r": "25.1.0"}.get(args[0] if args else "-s", "Darwin"))


def launchctl(args):
    """bootstrap system PLIST: start ProgramArguments as launchd would (RunAtLoad); bootout system/LABEL: stop it."""
    import plistlib
    import signal
    import subprocess

    log_command()
    if args[:2] == ["bootstrap", "system"]:
        job = plistlib.loads(Path(args[2]).read_bytes())
        if state(f"launchd-{job['Label']}.pid"):
            print(f"Bootstrap failed: 5: Input/output error (service {job['Label']} already loaded)", file=sys.stderr)
            sys.exit(5)
        log = open(job.get("StandardOutPath", "/dev/null"), "ab")
        proc = subprocess.Popen(job["ProgramArguments"], cwd=job.get("WorkingDirectory"), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        put(f"launchd-{job['Label']}.pid", str(proc.pid))
    elif args[:1] == ["bootout"]:
        label = args[1].removeprefix("system/")
        pid = state(f"launchd-{label}.pid")
        if pid is None:
            print(f"Boot-out failed: 3: No such process ({label})", file=sys.stderr)
            sys.exit(3)
        try:
            os.kill(int(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass
        (STATE / f"launchd-{label}.pid").unlink()
    else:
        sys.exit(f"standin launchctl: unsupported {args}")


TOOLS = {f.__name__: f for f in (system_profiler, networksetup, ipconfig, ibv_devices, ibv_devinfo, ifconfig, route,
                                 sudo, sysctl, shutdown, uname, launchctl)}

if __name__ == "__main__":
    TOOLS[Path(sys.argv[0]).name](sys.argv[1:])
