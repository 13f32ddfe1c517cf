"""`meshd-rank`: one rank of a tensor-parallel generation.

Started with the MLX distributed environment (the agent sets what `mlx.launch`
would), plus `MESHD_GENERATION` and `MESHD_STATUS_FILE`. Loads and shards the
model with per-layer progress, waits at the arm barrier, then runs the lockstep
loop until a drain: every rank leaves the loop at the same iteration,
synchronizes, closes its generator and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx_lm.utils
from mlx.utils import tree_flatten
from mlx_lm import load as load_whole
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_config, load_tokenizer

from common import openai_api as oa, proctitle
from common.prefills import EVERY, Watch
from common.fingerprint import loaded_digest, stamps
from common.tomlcheck import loopback
from common.states import RankState
from common.statusfile import RankStatus
from runtime.engine import grammar
from runtime.models import dspark, families
from runtime.engine.proposers import DraftModel, Head, Proposer, Stages, Undrafted
from runtime.engine.scheduler import adopt_restored, doze_before
from runtime.lockstep import Cancel, CompileGrammar, Drain, DrainMode, Insert, Message, RestoreFirst
from runtime.join import join_mesh
from runtime.engine.jobs import Divergence
from runtime.lockstep import Lockstep, fold
from runtime.models.overlay import OverlayError, check_loaded, checkpoint_tensors, disarm, drafter_off, overlay_for, set_up
from runtime.prefix.checkpoints import message_markers
from runtime.prefix.rates import Rates
from runtime.prefix.store import PrefixStore
from runtime.compiles import Compiles
from runtime.restore import Restorer
from runtime.engine.rowwise import RowwiseEngine
from runtime.prefix.snapshot import LEAVES, Identity, Snapshots, leaf_types, shard_layout, snapshot_key, snapshot_kind
from runtime.wake import rouse
from runtime.server import WARMUP, Frontend
from runtime.status import Heartbeat


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="meshd-rank", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="path of the model directory (mlx-lm format)")
    p.add_argument("--meshd-generation", dest="generation", type=int,
                   default=int(os.environ.get("MESHD_GENERATION", "0")),
                   help="generation id (default: $MESHD_GENERATION)")
    p.add_argument("--host", default="127.0.0.1", help="rank 0's internal HTTP address")
    p.add_argument("--port", type=int, default=8100, help="rank 0's internal HTTP port")
    p.add_argument("--seed", type=int, default=0, help="mx.random seed, the same on every rank")
    p.add_argument("--status-file", default=os.environ.get("MESHD_STATUS_FILE"),
                   help="heartbeat JSON path (default: $MESHD_STATUS_FILE)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="max_tokens of a request that names none (default 0: until the end of the context or a "
                        "stop, at most --max-tokens-limit)")
    p.add_argument("--max-tokens-limit", type=int, default=8192, help="largest max_tokens accepted")
    p.add_argument("--max-context", type=int, default=0,
                   help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--model-name", default=None, help="model id served (default: the directory name)")
    p.add_argument("--draft-model", default=None, help="draft model for speculative decoding")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="tokens drafted per step (default: 3 with --draft-model, 1 with a model's MTP head, "
                        "the block size with DSpark's stages, at most the block)")
    p.add_argument("--model-package", default=None,
                   help="a Python package imported before the model loads, which registers its model type "
                        "(and MTP head) into mlx-lm: a model overlay")
    p.add_argument("--drafter", choices=["auto", "off"], default="auto",
                   help="auto: draft with the model's own drafter when it has one (DSpark's stages, an MTP "
                        "head), every request row by row; off: continuous batching without drafts")
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--completion-batch-size", type=int, default=16)
    p.add_argument("--drain-deadline", type=float, default=30.0,
                   help="seconds a finishing drain may take before in-flight work is cancelled")
    p.add_argument("--drain-wait", type=float, default=10.0,
                   help="seconds a non-zero rank waits after SIGTERM for rank 0's drain")
    p.add_argument("--idle-interval", type=float, default=0.5,
                   help="longest pause between idle liveness collectives; ranks sleep in between")
    p.add_argument("--burst", type=int, default=4,
                   help="engine steps between control exchanges while busy (admission and "
                        "cancel latency, in steps)")
    p.add_argument("--heartbeat-interval", type=float, default=0.5,
                   help="seconds between status file writes while nothing changes state")
    p.add_argument("--prefill-report-every", type=float, default=EVERY,
                   help="seconds between two reports of one long prefill's progress (SSE comments of its stream, "
                        "the status file; common/prefills.py says which prefills are long)")
    p.add_argument("--snapshots", choices=["on", "off"], default="on",
                   help="prefix snapshots: each rank writes its shard of the token tape's caches to local disk, and "
                        "the next generation restores the tapes every rank holds whole while it serves "
                        "(runtime/prefix/snapshot.py, runtime/restore.py)")
    agent = os.environ.get("MESHD_AGENT")
    p.add_argument("--snapshot-dir", default=os.path.join(agent, "snapshots") if agent else "",
                   help="where this rank's snapshots live (default: snapshots/ in its agent's state_dir, "
                        "$MESHD_AGENT; without an agent, none: off)")
    p.add_argument("--snapshot-key", default=os.path.join(agent, "snapshot.key") if agent else "",
                   help="the node's snapshot key, which every segment's digest is keyed by (default: snapshot.key "
                        "in the agent's state_dir; without an agent, SNAPSHOT_DIR.key); created when missing")
    p.add_argument("--snapshot-budget-mb", type=int, default=8192,
                   help="disk the snapshots of this rank's directory may take; least recently used tapes go first")
    p.add_argument("--snapshot-max-age", type=float, default=7 * 86400,
                   help="seconds a tape no request used is kept on disk (default 7 days; 0: as long as the budget "
                        "allows); older ones are deleted at the start and as the writer goes")
    p.add_argument("--snapshot-every", type=int, default=256,
                   help="tokens between the snapshots of a tape as it grows (a prefill's chunks, an answer in flight)")
    p.add_argument("--checkpoint-budget-mb", type=int, default=1024,
                   help="memory the token tape's checkpoints may hold (windows and open pools of caches a trim "
                        "cannot cut back, runtime/prefix/checkpoints.py); past it the least recently used go first")
    p.add_argument("--grammar-cache-mb", type=int, default=grammar.CACHE_BYTES >> 20,
                   help="memory the compiled grammars of structured output may hold on each rank "
                        "(runtime/engine/grammar.py); past it the least recently used go first")
    p.add_argument("--backend", default="any",
                   help="mx.distributed backend (default: $MESHD_BACKEND, which the agent sets from the hostfile)")
    args = p.parse_args(argv)
    for flag in ("snapshot_every", "snapshot_budget_mb", "checkpoint_budget_mb"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)} "
                    "(to write no snapshots: --snapshots off)")
    if args.grammar_cache_mb < 1:
        p.error(f"--grammar-cache-mb must be at least 1, got {args.grammar_cache_mb}")
    if args.prefill_report_every < 0:
        p.error(f"--prefill-report-every must be 0 (every chunk) or more seconds, got {args.prefill_report_every}")
    return args


def load_sharded(model_path: Path, group, on_progress, overlay=None, log=print):
    """Load lazily through the loader in place now (an overlay's setup may have replaced it), check every
    checkpoint tensor landed, shard across `group` (DSpark's stages as the backbone's layers), then
    materialise layer by layer so progress is real: (layers and stages done, total)."""
    try:
        model, config = mlx_lm.utils.load_model(model_path, lazy=True)
    except ValueError as e:
        raise OverlayError(f"the checkpoint at {model_path} does not fit its model: {' '.join(str(e).split())[:800]}"
                           ) from None
    checkpoint = checkpoint_tensors(model_path)
    check_loaded(overlay, model, checkpoint, [k for k, _ in tree_flatten(model.parameters())])
    disarm(overlay, model)
    off = drafter_off(overlay, model, checkpoint)
    if off:
        log(off)
    if group.size() > 1:
        if not hasattr(model, "shard"):
            raise SystemExit(f"meshd-rank: {config.get('model_type')} models cannot be sharded "
                             "(no tensor-parallel support in mlx-lm); run a single rank")
        dspark.shard(model, group)
    dspark.gate_kernels(overlay and overlay.package, model, config, log)
    layers = list(model.layers) + dspark.stages(model)
    total = len(layers) + 1
    on_progress(0, total)
    for i, layer in enumerate(layers):
        mx.eval(layer.parameters())
        on_progress(i + 1, total)
    mx.eval(model.parameters())
    on_progress(total, total)
    return model


class Signals:
    """Signals as a handler records them: it only appends, since the code it
    interrupts may hold any lock (the frontend's, the heartbeat's). The loop
    takes them between exchanges and acts."""

    def __init__(self, *signums: int):
        self._seen: list[int] = []
        for signum in signums:
            signal.signal(signum, lambda n, frame: self._seen.append(n))

    def take(self) -> list[int]:
        taken, self._seen[:] = list(self._seen), []
        return taken


class LockstepLoop:
    """The loop every rank runs; rank 0 also feeds and drains the frontend.
    `on_term` is what SIGTERM means to this rank, run by the loop."""

    def __init__(self, engine, lockstep, heartbeat: Heartbeat, frontend=None, idle_interval: float = 0.5,
                 burst: int = 4, on_term=None, on_warm=None, wake=None, doze=time.sleep,
                 restorer: Restorer | None = None, prefill_report_every: float = EVERY):
        self.signals = Signals(signal.SIGTERM)
        # Armed until the warm-up generation finished on this rank: its first steps compile kernels, which
        # the agent gives the warm-up window, not a serving rank's.
        self.warming_since: float | None = None
        self.warm = False  # the warm-up generation finished: the rank is ready
        self.on_warm = on_warm or (lambda seconds: None)
        self.on_term = on_term or (lambda: None)
        self.digest = 0  # of every token this rank sampled, compared at each exchange
        self.sampled = 0  # tokens sampled; `tokens` counts those of clients' requests
        self.steps = 0
        # A fault for tests (MESHD_FAULT_FLIP_TOKEN=RANK:N): this rank's Nth sampled token counts as another
        # one, as if it had sampled differently.
        rank, _, n = os.environ.get("MESHD_FAULT_FLIP_TOKEN", "").partition(":")
        self.flip_at = int(n) if n and int(rank) == lockstep.rank else -1
        self.engine = engine
        self.lockstep = lockstep
        self.hb = heartbeat
        self.fe = frontend
        self.inflight: dict[str, int] = {}
        self.draining: DrainMode | None = None
        self.tokens = 0
        self.idle_interval = idle_interval
        self.burst = burst
        self.wake = wake  # rank 0: rouse the dozing ranks (runtime.wake)
        self.doze = doze  # the others: sleep until the next exchange or until roused
        self.restorer = restorer  # snapshots restored while serving
        self.compiles = Compiles(frontend.fail if frontend else None)  # held answers' grammars, compiled behind
        self.prefills = Watch(prefill_report_every)  # the long prefills, said to their streams and the status file
        self._active_at = time.monotonic()

    def _apply(self, msg: Message) -> None:
        match msg:
            case Insert(job) if self.draining:
                self._refuse(job.rid)
            case Insert(job):
                cached = self.engine.insert(job)
                self.inflight[job.rid] = len(job.prompt)
                if job.rid == WARMUP:
                    self.warming_since = time.monotonic()
                if self.fe and cached is not None:  # None: the engine says it with the job's first token
                    self.fe.started(job.rid, cached)
            case Cancel(rid):
                if self.inflight.pop(rid, None) is not None:
                    self.engine.cancel(rid)
            case RestoreFirst(sid):
                self.restorer.first(sid)
            case CompileGrammar(text):
                self.compiles.start(text)
            case Drain(mode):
                self.draining = DrainMode.CANCEL if self.draining == DrainMode.CANCEL else mode
                if self.draining == DrainMode.CANCEL:
                    for rid in list(self.inflight):
                        self.engine.cancel(rid)
                        self._refuse(rid)
                    self.inflight.clear()

    def _refuse(self, rid: str) -> None:
        if self.fe:
            self.fe.fail(rid, "The generation is draining; this request was cancelled. Retry it", code="draining")

    def run(self) -> None:
        doze = 0.0
        while True:
            if self.signals.take():
                self.on_term()
            outbox, idle_next, burst = None, 0.0, 1
            restoring = self.restorer is not None and bool(self.restorer.pending)
            if self.fe:
                outbox = self.compiles.screen(self.fe.collect(block=not self.engine.busy, timeout=doze))
                if restoring or (self.restorer and self.restorer.holding):
                    outbox = self.restorer.screen(outbox, through=WARMUP)
                if outbox and doze and self.wake:
                    self.wake()  # the others doze until the exchange this work waits for
                if outbox or self.engine.busy or self.draining:
                    self._active_at = time.monotonic()
                    burst = self.burst if (self.engine.busy and not outbox) else 1
                else:
                    idle_next = doze_before(time.monotonic() - self._active_at, self.idle_interval,
                                            restoring or self.compiles.waiting,
                                            bool(self.restorer and self.restorer.holding and self.restorer.buildable))
            try:
                msgs, doze, steps = self.lockstep.exchange(outbox, idle_next, burst, self.digest)
            except Divergence as e:
                raise Divergence(f"{e} at step {self.steps}") from None
            for msg in msgs:
                self._apply(msg)
            if self.compiles.pending:
                self.compiles.agree(self.lockstep.gather)
            if restoring and adopt_restored(self.warm, bool(self.draining), self.engine.busy,
                                            bool(self.restorer.awaited)):
                self.restorer.adopt(self.lockstep.gather)
            if self.draining and not self.engine.busy:
                return
            if not self.engine.busy:
                self.hb.update(progress=True, state=RankState.DRAINING if self.draining else RankState.READY,
                               requests_in_flight=0, prompt_tokens_in_flight=0, prefills=[], **self.engine.stats())
                if not self.fe and doze:
                    self.doze(doze)
                continue
            for _ in range(steps):
                if not self.engine.busy:
                    break
                self._step()

    def _state(self) -> RankState:
        if self.draining:
            return RankState.DRAINING
        return RankState.ARMED if self.warming_since is not None else RankState.BUSY

    def _step(self) -> None:
        self.hb.update(state=self._state(),
                       requests_in_flight=len(self.inflight),
                       prompt_tokens_in_flight=self.engine.prompt_tokens_in_flight())
        emissions = self.engine.step()
        self.steps += 1
        for e in emissions:
            if e.token is not None:
                self.sampled += 1
                self.tokens += e.rid != WARMUP
                self.digest = fold(self.digest, e.token ^ (self.sampled == self.flip_at))
            if e.finish_reason is not None:
                self.inflight.pop(e.rid, None)
                if e.rid == WARMUP:
                    self.on_warm(time.monotonic() - self.warming_since)
                    self.warming_since = None
                    self.warm = True
        said, long = self.prefills.step(self.engine.prefilling(), time.monotonic())
        self.hb.update(progress=True, tokens=self.tokens, prefills=[p.shown() for p in long], **self.engine.stats())
        if self.fe and said:
            self.fe.prefilled(said)
        if self.fe and emissions:
            self.fe.emit(emissions)


def mlx_memory() -> dict:
    return {"mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory(),
            "mlx_cache_bytes": mx.get_cache_memory()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    overlay, secret = refuse_early(args)
    hb, log, group = join(args)
    rank, world = group.rank(), group.size()
    model_path = Path(args.model)
    config = load_config(model_path)
    families.refuse(config, draft=args.draft_model, batch=args.completion_batch_size)
    tokenizer = load_tokenizer(model_path, eos_token_ids=config.get("eos_token_id"))
    # every rank compiles the grammars answers are held to (runtime/engine/grammar.py)
    grammar.serve(tokenizer, args.grammar_cache_mb << 20)
    args.message_markers = message_markers(tokenizer)  # where prompts stop for checkpoints (runtime/prefix)
    context = args.max_context or int(config.get("max_position_embeddings", 4096))
    frontend = open_frontend(args, tokenizer, context, secret) if rank == 0 else None
    model, loaded_in = load(args, group, hb, overlay, log)
    if frontend:  # the controller learns what it serves from the answer that says it is ready
        frontend.weights_fingerprint = args.weights_fingerprint
    engine = make_engine(args, model, set(tokenizer.eos_token_ids), rank, world, hb, log)
    lockstep = Lockstep(group)
    restorer = restore_behind(engine.prefixes, model, lockstep, loaded_in, log, rank)
    wake, doze = rouse(lockstep, secret, args.generation, log)  # the arm barrier too: all are loaded past it
    hb.update(state=RankState.ARMED)
    log("armed")
    ready = f"ready on {args.host}:{args.port}" if rank == 0 else "ready"
    loop = LockstepLoop(engine, lockstep, hb, frontend, idle_interval=args.idle_interval,
                        burst=args.burst, on_term=_on_term(frontend, args.drain_wait, log),
                        wake=wake, doze=doze, prefill_report_every=args.prefill_report_every,
                        on_warm=lambda seconds: log(f"warmed up (one token through every rank) in {seconds:.1f}s; "
                                                    f"{ready}"),
                        restorer=restorer)
    if frontend:
        frontend.warm_up(warmup_prompt(tokenizer))
    serve(loop, engine, frontend, hb, log)


def refuse_early(args) -> tuple:
    """What must hold before anything starts, each refused with its fix: the overlay set up, a model at
    --model, a secret off loopback. Returns the overlay and the rank secret (taken out of the environment)."""
    overlay = overlay_for(args.model_package)
    try:
        if overlay:
            set_up(overlay)
    except OverlayError as e:
        sys.exit(f"meshd-rank: {e}")
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"meshd-rank: no model at {Path(args.model)} (config.json missing); "
                 "pass --model with an mlx-lm model directory")
    secret = os.environ.pop("MESHD_RANK_SECRET", "")
    if not secret and not loopback(args.host):
        sys.exit(f"meshd-rank: --host {args.host} is off loopback and MESHD_RANK_SECRET is not set: anyone who "
                 "reaches it could drain the mesh; set the secret (the agent does) or listen on 127.0.0.1")
    return overlay, secret


def join(args) -> tuple[Heartbeat, Callable[[str], None], "mx.distributed.Group"]:
    """The heartbeat, this rank's log, and the mesh joined (the heartbeat starts before the join: a rank
    waiting for its peers to connect is loading, not gone)."""
    rank = int(os.environ.get("MLX_RANK", "0"))
    node = os.environ.get("MESHD_NODE", "")
    proctitle.set_title(proctitle.rank(args.generation, rank, None, node))
    hb = Heartbeat(args.status_file, RankStatus(args.generation, rank, 0, os.getpid()),
                   interval=args.heartbeat_interval, sample=mlx_memory).start()
    log = _logger(rank, args.generation)
    began = time.monotonic()
    group = join_mesh(args.backend)
    rank, world = group.rank(), group.size()
    proctitle.set_title(proctitle.rank(args.generation, rank, world, node))
    hb.update(rank=rank, world=world, flush=True)
    log(f"joined as rank {rank} of {world} in {time.monotonic() - began:.1f}s")
    mx.random.seed(args.seed)
    return hb, log, group


def open_frontend(args, tokenizer, context: int, secret: str) -> Frontend:
    """Rank 0's HTTP frontend, listening (its doors shut until the warm-up)."""
    limits = oa.Limits(args.model_name or Path(args.model).name, args.max_tokens, args.max_tokens_limit)
    frontend = Frontend(tokenizer, limits, generation=args.generation, context_length=context,
                        host=args.host, port=args.port, drain_deadline=args.drain_deadline, secret=secret)
    try:
        frontend.start()
    except OSError as e:
        sys.exit(f"meshd-rank: cannot listen on {args.host}:{args.port} ({e}); pick a free --port")
    return frontend


def load(args, group, hb: Heartbeat, overlay, log) -> tuple:
    """This rank's shard of the model, its progress in the heartbeat and the log; and the seconds it took."""
    def progress(done: int, total: int) -> None:
        hb.update(progress=True, flush=True, load_done=done, load_total=total)
        log(f"loading {done}/{total}")

    began, before = time.monotonic(), stamps(Path(args.model))
    try:
        model = load_sharded(Path(args.model), group, progress, overlay, log)
    except OverlayError as e:
        sys.exit(f"meshd-rank: {e}")
    loaded_in = time.monotonic() - began
    args.weights_fingerprint = loaded_digest(Path(args.model), before)  # what it loaded, "" if they changed
    log(f"loaded in {loaded_in:.1f}s from {Path(args.model)}, weights "
        f"{args.weights_fingerprint or 'changed while it loaded'}")
    hb.update(kernels_hidden=len(dspark.HIDDEN),  # whichever engine runs the model, drafted or not
              weights_fingerprint=args.weights_fingerprint)
    return model, loaded_in


def make_engine(args, model, eos: set[int], rank: int, world: int, hb: Heartbeat, log) -> RowwiseEngine:
    """The engine: every request row by row (a request alone is a batch of one), drafted by a draft model,
    DSpark's stages or the model's MTP head, or by nobody. It takes the one prefix store built here
    (`engine.prefixes`)."""
    prefixes = prefix_store(args, Path(args.model), model, rank, world, log)
    proposer = proposer_for(args, model)
    engine = RowwiseEngine(model, eos, proposer, prefixes=prefixes, num_draft_tokens=args.num_draft_tokens or 0,
                           prefill_step_size=args.prefill_step_size,
                           completion_batch_size=args.completion_batch_size, log=log)
    hb.update(**engine.stats())
    if engine.width:
        log(f"drafter armed: {proposer.armed(engine.width)}, every request drafted row by row (a request alone is "
            "a batch of one)")
    return engine


def proposer_for(args, model) -> Proposer:
    """Who drafts: the --draft-model, else with --drafter auto DSpark's stages or the model's MTP head; nobody
    (`Undrafted`) when nothing does."""
    if args.draft_model:
        return DraftModel(model, load_whole(args.draft_model)[0], args.prefill_step_size)
    if args.drafter == "auto" and dspark.stages(model):
        return Stages(model)
    if args.drafter == "auto" and hasattr(model, "mtp_draft"):
        return Head(model)
    return Undrafted(model)


def restore_behind(prefixes: PrefixStore, model, lockstep: Lockstep, loaded_in: float, log,
                   rank: int) -> Restorer:
    """The restores of the tapes every rank holds into the engine's prefix store, behind serving; every rank
    agrees on them here, a collective."""
    if not prefixes.rates.read_bps:  # nothing measured before: what reading the weights took
        prefixes.rates.note(read_bps=sum(v.nbytes for _, v in tree_flatten(model.parameters())) / max(loaded_in, 1e-3))
    restorer = Restorer.agree(prefixes.snapshots, lockstep.gather, prefixes.tape, prefixes.fresh, prefixes.rates,
                              log, rank)
    if restorer.pending:
        log(f"restoring {len(restorer.pending)} tape(s) from snapshots while serving, most recent first")
    return restorer


def serve(loop: LockstepLoop, engine, frontend: Frontend | None, hb: Heartbeat, log) -> None:
    """Run the lockstep loop to its drain and exit cleanly; a failure fails every request in flight and ends
    the process with 1 at once."""
    try:
        loop.run()
    except Exception:
        traceback.print_exc()
        if frontend:
            frontend.fail_all("A rank of this generation failed; the request was not finished. Retry it")
        hb.stop()
        sys.stderr.flush()
        os._exit(1)
    hb.update(state=RankState.DRAINING)
    if loop.restorer:  # a tape it reads meanwhile is left: the next generation restores it
        loop.restorer.close()
    mx.synchronize()
    engine.close()
    log("drained, exiting 0")
    if frontend:
        frontend.stop()
    hb.stop()
    # Drained: a late SIGTERM is ignored from here. The interpreter's finalization
    # would otherwise restore its default action (a clean drain turned into a
    # death by signal), and a normal exit runs the transport's destructors, which
    # free RDMA resources that a kill leaks.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def prefix_store(args, model_path: Path, model, rank: int, world: int, log) -> PrefixStore:
    """The prefix store the args ask for, with this rank's snapshots and where its rates are kept."""
    snaps = open_snapshots(args, model_path, model, rank, world, log)
    return PrefixStore(model, prefill_step_size=args.prefill_step_size, snapshots=snaps,
                       rates=Rates(snaps.folder / "rates.json" if snaps else None), markers=args.message_markers,
                       checkpoint_budget=args.checkpoint_budget_mb << 20)


def open_snapshots(args, model_path: Path, model, rank: int, world: int, log) -> Snapshots | None:
    """This rank's snapshots as the args ask, or None (off, a cache type whose state is not proven to restore
    exactly, a directory it cannot use: each said in the log)."""
    if args.snapshots == "off" or not args.snapshot_dir:
        return None
    types = leaf_types(make_prompt_cache(model))
    if snapshot_kind(types) is None:
        log(f"snapshots off: this model's caches ({', '.join(sorted(set(types) - set(LEAVES)))}) cannot be "
            f"snapshotted exactly, only {', '.join(LEAVES)}")
        return None
    if not args.weights_fingerprint:
        log("snapshots off: the weights changed while this rank loaded them, which of them it holds is not known")
        return None
    try:
        me = Identity(args.weights_fingerprint, world, rank, shard_layout(model))
        key = snapshot_key(Path(args.snapshot_key or args.snapshot_dir.rstrip("/") + ".key"))
        return Snapshots(Path(args.snapshot_dir), me, args.snapshot_budget_mb << 20, args.snapshot_every, log, key,
                         args.snapshot_max_age)
    except OSError as e:
        log(f"snapshots off: {args.snapshot_dir} cannot be used ({e}); check its permissions and free space")
        return None


def warmup_prompt(tokenizer) -> list[int]:
    """A short prompt as a client's would be, through the model's own chat template when it has one."""
    messages = [{"role": "user", "content": "ping"}]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode("ping"))


def _logger(rank: int, generation: int):
    def log(msg: str) -> None:
        print(f"[meshd-rank g{generation} r{rank}] {msg}", file=sys.stderr, flush=True)
    return log


def _on_term(frontend, drain_wait: float, log):
    """What SIGTERM means: rank 0 starts a finishing drain. Another rank waits,
    bounded, for rank 0's drain to reach it, then gives up with 128+SIGTERM."""
    timers: list[threading.Timer] = []

    def give_up() -> None:
        log("no drain arrived, exiting")
        os._exit(128 + signal.SIGTERM)

    def on_term() -> None:
        if frontend is not None:
            log("SIGTERM: draining")
            frontend.begin_drain(DrainMode.FINISH)
        elif not timers:
            log(f"SIGTERM: waiting up to {drain_wait}s for rank 0's drain")
            timers.append(threading.Timer(drain_wait, give_up))
            timers[0].daemon = True
            timers[0].start()
    return on_term


if __name__ == "__main__":
    main()
