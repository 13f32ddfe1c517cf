"""`meshctl model pull REPO`: the Hugging Face download happens once, on one
node (its network, its `huggingface_hub`), then the repo's cache directory
(blobs, snapshot links, refs) is copied to every other node's Hugging Face
cache over SSH, relayed through this machine, with progress; files already
there with the right size are kept. Before the download, the source checks the
checkpoint from its config and its safetensors headers (range requests;
common/checkpoint.py), each finding said with its key and fix: one that will
not load is not downloaded; after it, the downloaded copy is checked again
before any copy. Last, every node computes the fingerprint `meshctl doctor`
compares, and they must agree."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Callable

from common.checkpoint import Report
from common.modelref import is_repo_id
from meshd.nodes import provision
from meshd.config import MeshConfig
from meshd.meshctl.progress import Block, bar
from meshd.nodes.ssh import Session, SshError

CHUNK = 1 << 20
# The node's meshd interpreter (agents install puts it in ~/.meshd/venv), else its python3.
PYTHON = 'p=~/.meshd/venv/bin/python; [ -x "$p" ] || p=python3; "$p"'
DOWNLOAD = ("import sys; from huggingface_hub import snapshot_download; "
            "print(snapshot_download(sys.argv[1]))")
LISTING = ("import json, os, sys; from pathlib import Path; root = Path(sys.argv[1]); out = []\n"
           "for d, dirs, files in os.walk(root):\n"
           "    for n in sorted(dirs + files):\n"
           "        p = Path(d, n); rel = str(p.relative_to(root))\n"
           "        if p.is_symlink(): out.append(['link', rel, os.readlink(p), 0])\n"
           "        elif p.is_dir(): out.append(['dir', rel, '', 0])\n"
           "        else: out.append(['file', rel, '', p.stat().st_size])\n"
           "print(json.dumps(out))")
CACHE = "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"
PRECHECK = ("import json, sys; from common.checkpoint import survey_repo; "
            "print(json.dumps(survey_repo(sys.argv[1]).to_dict()))")
CHECKPOINT = ("import json, sys; from pathlib import Path; from common.checkpoint import survey; "
              "print(json.dumps(survey(Path(sys.argv[1])).to_dict()))")
FINGERPRINT = ("import json, sys; from agents.node import model_fingerprint; from common.modelref import resolve; "
               "print(json.dumps(model_fingerprint(str(resolve(sys.argv[1])))))")


class PullError(Exception):
    """Names the node, what failed and the fix."""


@dataclass(frozen=True)
class Entry:
    kind: str  # dir | link | file
    path: str  # relative to the repo's cache directory (models--ORG--NAME)
    target: str  # a link's target
    size: int


def python(session: Session, code: str, *args: str, timeout: float = 120) -> str:
    r = session.run(f"{PYTHON} -c {shlex.quote(code)} " + " ".join(shlex.quote(a) for a in args), timeout=timeout)
    if not r.ok:
        raise PullError(f"{session.target.node}: {(r.stderr or r.stdout).strip()[-400:]}")
    return r.stdout.strip().splitlines()[-1]


def wanted(entries: list[Entry], have: dict[str, int], force: bool) -> list[Entry]:
    """The files to copy: those missing or of another size there (all of them with `force`)."""
    return [e for e in entries if e.kind == "file" and (force or have.get(e.path) != e.size)]


def said(report: Report) -> list[str]:
    """The source's check of the checkpoint, a line for each finding and one for its drafting."""
    lines = [f"{'FAIL' if f.fatal else 'WARN'} {f.key}: {f.problem}\n     fix: {f.fix}" for f in report.findings]
    if d := report.drafting:
        lines.append((d.why if d.dspark else f"serves undrafted: {d.why}") + (f"\n     fix: {d.fix}" if d.fix else ""))
    return lines


def pull(cfg: MeshConfig, repo: str, *, source: str | None = None, force: bool = False, trust_new: bool = False,
         say: Callable[[str], None] = print) -> dict[str, str]:
    """Download `repo` on `source` (the first node by default), copy it to the others; the fingerprints."""
    if not is_repo_id(repo):
        raise PullError(f"{repo!r} is not a Hugging Face repo id (ORG/NAME); a model directory is copied with "
                        f"rsync, and `meshctl doctor` checks the copies")
    targets = {t.node: t for t in provision.targets(cfg)}
    source = source or cfg.nodes[0].name
    if source not in targets:
        raise PullError(f"--from {source}: no such node; nodes: {', '.join(targets)}")
    try:
        with Session(targets[source], cfg.ssh, trust_new=trust_new) as src:
            report = Report.from_dict(json.loads(python(src, PRECHECK, repo)))
            for line in said(report):
                say(f"{source}: {repo}: {line}")
            if refusal := report.refusal():
                raise PullError(f"{repo}: {refusal}; nothing was downloaded")
            say(f"{source}: downloading {repo} into its Hugging Face cache (huggingface_hub, its network)")
            snapshot = python(src, DOWNLOAD, repo, timeout=24 * 3600)
            repo_dir = snapshot.rsplit("/snapshots/", 1)[0]
            entries = [Entry(*e) for e in json.loads(python(src, LISTING, repo_dir))]
            total = sum(e.size for e in entries if e.kind == "file")
            say(f"{source}: {repo} is {total / 2**30:.2f} GiB in {sum(e.kind == 'file' for e in entries)} files")
            if refusal := Report.from_dict(json.loads(python(src, CHECKPOINT, snapshot))).refusal():
                raise PullError(f"{repo}: {refusal}; it is downloaded on {source} only, not copied to the other nodes")
            src_sftp = src.client.open_sftp()
            for node in (n.name for n in cfg.nodes if n.name != source):
                with Session(targets[node], cfg.ssh, trust_new=trust_new) as dst:
                    copy_to(src_sftp, repo_dir, dst, entries, force, say)
            src_sftp.close()
        prints = {}
        for node, target in targets.items():
            with Session(target, cfg.ssh, trust_new=trust_new) as s:
                prints[node] = json.loads(python(s, FINGERPRINT, repo)).get("fingerprint")
    except SshError as e:
        raise PullError(str(e)) from None
    if len(set(prints.values())) != 1 or None in prints.values():
        raise PullError(f"the copies differ: fingerprints {prints}; run `meshctl model pull {repo} --force`")
    say(f"{repo}: the same on {len(prints)} nodes (fingerprint {next(iter(prints.values()))}); "
        f'set [runtime] model = "{repo}"')
    return prints


def copy_to(src_sftp, repo_dir: str, dst: Session, entries: list[Entry], force: bool,
            say: Callable[[str], None]) -> None:
    node = dst.target.node
    cache = python(dst, CACHE)
    dest = f"{cache}/{repo_dir.rsplit('/', 1)[1]}"
    dst_sftp = dst.client.open_sftp()
    try:
        run = dst.run(f"mkdir -p {shlex.quote(dest)}")
        if not run.ok:
            raise PullError(f"{node}: cannot create {dest}: {run.stderr.strip()}")
        have = {}
        for e in entries:
            if e.kind == "file":
                try:
                    have[e.path] = dst_sftp.stat(f"{dest}/{e.path}").st_size
                except OSError:
                    pass
        todo = wanted(entries, have, force)
        total, done = sum(e.size for e in todo), 0
        block = Block()
        say(f"{node}: {len(todo)} files to copy into {dest}" + (" (the rest is already there)" if have else ""))
        for e in entries:
            if e.kind == "dir":
                dst.run(f"mkdir -p {shlex.quote(f'{dest}/{e.path}')}")
        for e in todo:
            tmp = f"{dest}/{e.path}.meshd-partial"
            with src_sftp.open(f"{repo_dir}/{e.path}", "rb") as f, dst_sftp.open(tmp, "wb") as g:
                f.prefetch()
                g.set_pipelined(True)
                while chunk := f.read(CHUNK):
                    g.write(chunk)
                    done += len(chunk)
                    block.draw([f"  {node:<12} {bar(done, total)} {done / 2**30:.2f}/{total / 2**30:.2f} GiB"])
            dst_sftp.posix_rename(tmp, f"{dest}/{e.path}")
        for e in entries:
            if e.kind == "link":
                dst.run(f"ln -sfn {shlex.quote(e.target)} {shlex.quote(f'{dest}/{e.path}')}")
        block.finish(f"{node}: {repo_dir.rsplit('/', 1)[1]} copied ({done / 2**30:.2f} GiB)")
    finally:
        dst_sftp.close()
