"""The agent's Prometheus collector: its ranks, read from the supervisor at scrape time."""

from __future__ import annotations

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agents.supervisor import Supervisor
from common import procs

TAPE_OUTCOMES = (("hit", "tape_hits"), ("miss", "tape_misses"), ("not_reusable", "tape_not_reusable"))


class AgentMetrics:
    """Read the supervisor at scrape time."""

    def __init__(self, sup: Supervisor):
        self.sup = sup

    def collect(self):
        node = self.sup.config.node
        up = GaugeMetricFamily("meshd_agent_rank_up", "1 while the rank process of this node runs",
                               labels=["node", "rank"])
        rss = GaugeMetricFamily("meshd_agent_rank_resident_memory_bytes", "Resident memory of the rank",
                                labels=["node", "rank"])
        cpu = CounterMetricFamily("meshd_agent_rank_cpu_seconds", "CPU time of the rank",
                                  labels=["node", "rank"])
        mlx = GaugeMetricFamily("meshd_agent_rank_mlx_memory_bytes",
                                "MLX memory of the rank, from its status file: active (in arrays), peak, cache",
                                labels=["node", "rank", "kind"])
        armed = GaugeMetricFamily("meshd_agent_rank_drafter_armed", "1 while a drafter drafts (the model's MTP head, "
                                  "DSpark's stages or a draft model)",
                                  labels=["node", "rank"])
        drafts = CounterMetricFamily("meshd_agent_rank_draft_tokens", "Draft tokens the drafter proposed and the "
                                     "target accepted", labels=["node", "rank", "kind"])
        refusals = CounterMetricFamily("meshd_agent_rank_draft_fallbacks", "Requests the drafter refused (a "
                                       "shape), decoded plainly instead", labels=["node", "rank"])
        refeeds = CounterMetricFamily("meshd_agent_rank_draft_refeeds", "Verifies whose kept places went through "
                                      "the target again (a cache whose writes could not be cut back): a second "
                                      "forward that step", labels=["node", "rank"])
        batched = CounterMetricFamily("meshd_agent_rank_draft_batched_steps", "Verifies that drafted two rows or more "
                                      "at once (the drafting engine's batch)", labels=["node", "rank"])
        hidden = GaugeMetricFamily("meshd_agent_rank_kernels_hidden", "The model's kernels the rank hid at load "
                                   "(they refuse its share of the heads; the model takes its portable path)",
                                   labels=["node", "rank"])
        tape = CounterMetricFamily("meshd_agent_rank_tape_lookups", "Prompts looked up in the token tape, by "
                                   "outcome: hit (a cache reused exactly), miss (no shared prefix), not_reusable "
                                   "(a shared prefix the cache could not be cut back to)",
                                   labels=["node", "rank", "outcome"])
        checkpoint_bytes = GaugeMetricFamily("meshd_agent_rank_tape_checkpoint_bytes", "Memory the token tape's "
                                             "checkpoints hold (the windows and open pools of caches a trim cannot "
                                             "cut back), within --checkpoint-budget-mb", labels=["node", "rank"])
        snapshots = CounterMetricFamily("meshd_agent_rank_snapshots", "Prefix snapshots: segments written, tapes "
                                        "restored at load", labels=["node", "rank", "outcome"])
        snapshots_skipped = CounterMetricFamily("meshd_agent_rank_snapshots_skipped", "Prefix snapshots not used "
                                                "or not written, by reason (missing, truncated, corrupt, foreign, "
                                                "disk_full, budget, write_failed, capacity, superseded)",
                                                labels=["node", "rank", "reason"])
        snapshot_bytes = GaugeMetricFamily("meshd_agent_rank_snapshot_bytes", "What the rank's snapshot directory "
                                           "holds on disk", labels=["node", "rank"])
        snapshot_checkpoint_bytes = GaugeMetricFamily("meshd_agent_rank_snapshot_checkpoint_bytes", "Of what the "
                                                      "rank's snapshot directory holds, the tapes' checkpoints",
                                                      labels=["node", "rank"])
        gen = GaugeMetricFamily("meshd_agent_generation", "Generation of the live rank (-1 when none)",
                                labels=["node"])
        for rec in self.sup.live():
            res = procs.resources(rec.target)
            up.add_metric([node, str(rec.rank)], 1)
            rss.add_metric([node, str(rec.rank)], res["rss_bytes"])
            cpu.add_metric([node, str(rec.rank)], res["cpu_seconds"])
            status = rec.status
            if status is None:
                continue
            for kind in ("active", "peak", "cache"):
                mlx.add_metric([node, str(rec.rank), kind], getattr(status, f"mlx_{kind}_bytes"))
            if status.drafter:
                armed.add_metric([node, str(rec.rank)], 1)
                drafts.add_metric([node, str(rec.rank), "proposed"], status.draft_proposed)
                drafts.add_metric([node, str(rec.rank), "accepted"], status.draft_accepted)
                refusals.add_metric([node, str(rec.rank)], status.draft_fallbacks)
                refeeds.add_metric([node, str(rec.rank)], status.draft_refeeds)
                batched.add_metric([node, str(rec.rank)], status.draft_batched_steps)
            hidden.add_metric([node, str(rec.rank)], status.kernels_hidden)
            for outcome, field in TAPE_OUTCOMES:
                tape.add_metric([node, str(rec.rank), outcome], getattr(status, field))
            checkpoint_bytes.add_metric([node, str(rec.rank)], status.tape_checkpoint_bytes)
            snapshots.add_metric([node, str(rec.rank), "written"], status.snapshots_written)
            snapshots.add_metric([node, str(rec.rank), "restored"], status.snapshots_restored)
            for reason, n in sorted(status.snapshots_skipped.items()):
                snapshots_skipped.add_metric([node, str(rec.rank), reason], n)
            snapshot_bytes.add_metric([node, str(rec.rank)], status.snapshot_bytes)
            snapshot_checkpoint_bytes.add_metric([node, str(rec.rank)], status.snapshot_checkpoint_bytes)
        current = self.sup.current_generation()
        gen.add_metric([node], -1 if current is None else current)
        exits = CounterMetricFamily("meshd_agent_rank_exits", "Rank exits by kind", labels=["node", "kind"])
        for kind, n in self.sup.counters.exits.items():
            exits.add_metric([node, kind], n)
        sigs = CounterMetricFamily("meshd_agent_signatures", "Fatal log lines seen, by signature",
                                   labels=["node", "signature", "severity"])
        for (name, severity), n in self.sup.counters.signatures.items():
            sigs.add_metric([node, name, severity], n)
        orphans = CounterMetricFamily("meshd_agent_orphans_killed", "Orphaned processes killed by sweeps",
                                      labels=["node"])
        orphans.add_metric([node], self.sup.counters.orphans_killed)
        survivors = CounterMetricFamily("meshd_agent_survivors", "Processes that survived SIGKILL",
                                        labels=["node"])
        survivors.add_metric([node], self.sup.counters.survivors)
        reboot = GaugeMetricFamily("meshd_agent_reboot_required", "1 when this node needs a reboot",
                                   labels=["node"])
        reboot.add_metric([node], 1 if self.sup.reboot_required else 0)
        mem = psutil.virtual_memory()
        memory = GaugeMetricFamily("meshd_agent_node_memory_bytes", "Node memory", labels=["node", "kind"])
        memory.add_metric([node, "total"], mem.total)
        memory.add_metric([node, "available"], mem.available)
        events = CounterMetricFamily("meshd_agent_events", "Events emitted", labels=["node"])
        events.add_metric([node], self.sup.events.seq)
        yield from (up, rss, cpu, mlx, armed, drafts, refusals, refeeds, batched, hidden, tape, checkpoint_bytes,
                    snapshots, snapshots_skipped, snapshot_bytes, snapshot_checkpoint_bytes, gen, exits, sigs, orphans,
                    survivors, reboot, memory, events)

