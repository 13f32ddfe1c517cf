"""The controller's and the proxy's Prometheus metrics (each process its own registry):
`meshd_` prefix, base units, `_total` counters, `_seconds` histograms, low-cardinality labels."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from common.buildinfo import register_process_metrics
from common.states import Phase

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
DETECTION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


def _registry(mesh: str, component: str) -> CollectorRegistry:
    r = CollectorRegistry()
    Info("meshd_mesh", f"The mesh this {component} serves", registry=r).info({"mesh": mesh})
    register_process_metrics(r, component)
    return r


class Metrics:
    def __init__(self, mesh: str):
        r = self.registry = _registry(mesh, "controller")
        self.desired_up = Gauge("meshd_desired_up", "1 when the operator asked for the mesh to serve (meshctl up), "
                                "0 after a deliberate meshctl down", registry=r)
        self.agent_up = Gauge("meshd_agent_up", "1 while the controller holds the agent's event stream",
                              ["node"], registry=r)
        self.fleet_state = Gauge("meshd_fleet_state", "1 for the fleet's current phase", ["phase"], registry=r)
        self.generation = Gauge("meshd_generation", "Current generation", registry=r)
        self.restarts = Counter("meshd_restarts_total", "Generations ended by a failure, by cause", ["reason"],
                                registry=r)
        self.recycles = Counter("meshd_recycles_total", "Generations ended on purpose by planned recycling "
                                "([recycle]), by trigger (age, window)", ["reason"], registry=r)
        self.detection = Histogram("meshd_detection_seconds",
                                   "From an agent observing a death to the controller acting on it",
                                   buckets=DETECTION_BUCKETS, registry=r)
        self.recovery = Histogram("meshd_recovery_seconds", "From an incident to serving again",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.recovery_steps = Histogram("meshd_recovery_step_seconds",
                                        "Each step of a recovery (stopped, swept, backoff, started, loaded, ready, "
                                        "served), from the step before it", ["step"], buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.store_errors = Counter("meshd_store_errors_total", "Writes to the controller's store (SQLite in its "
                                    "state directory) that failed: a full disk, a quota", registry=r)
        self.store_pending = Gauge("meshd_store_pending_writes", "Writes acted on and waiting to be written to "
                                   "the store", registry=r)
        self.set_phase(Phase.STOPPED)

    def set_phase(self, phase: str) -> None:
        for p in Phase:
            self.fleet_state.labels(phase=p).set(1 if p == phase else 0)


class ProxyMetrics:
    """meshd-proxy's: what clients met (requests, queueing, tokens, latency) and what it did for them."""

    def __init__(self, mesh: str):
        r = self.registry = _registry(mesh, "proxy")
        self.requests = Counter("meshd_proxy_requests_total", "Proxied requests by route and status",
                                ["route", "status"], registry=r)
        self.queue_depth = Gauge("meshd_proxy_queue_depth", "Requests waiting for admission", registry=r)
        self.queue_limit = Gauge("meshd_proxy_queue_limit", "Requests that may wait before 429", registry=r)
        self.in_flight = Gauge("meshd_proxy_requests_in_flight", "Requests admitted and running", registry=r)
        self.queue_wait = Histogram("meshd_proxy_queue_wait_seconds", "Time a request waited for admission",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("meshd_proxy_time_to_first_token_seconds", "Time to the first streamed token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("meshd_proxy_inter_token_seconds", "Time between streamed chunks",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("meshd_proxy_tokens_total", "Completion tokens served", registry=r)
        self.draft_tokens = Counter("meshd_proxy_draft_tokens_total", "Draft tokens of the answers served, by model "
                                    "and outcome (proposed, accepted: a token of the answer), as their usage says",
                                    ["model", "outcome"], registry=r)
        self.probes = Counter("meshd_proxy_probes_total", "Idle probes sent to rank 0, by result (ok, failed)",
                              ["result"], registry=r)
        self.migrations = Counter("meshd_proxy_migrations_total",
                                  "Streams cut by a generation's death and resumed on the next one", registry=r)
        self.retries = Counter("meshd_proxy_retries_total", "Requests retried on the next generation", registry=r)
        self.routed = Counter("meshd_proxy_routed_total", "Attempts sent to a mesh, by mesh and why: model (the one "
                              "mesh of it), affinity (its tape holds the conversation), queue (the least loaded), "
                              "failover (after an attempt failed), fallback (no mesh of the model served)",
                              ["mesh", "reason"], registry=r)
        self.mesh_ready = Gauge("meshd_proxy_mesh_ready", "1 while the mesh serves a generation", ["mesh"], registry=r)
        self.connections = Gauge("meshd_proxy_connections", "Client connections open", registry=r)
        self.refused = Counter("meshd_proxy_refused_connections_total", "Client connections the listener's limits "
                               "ended, by reason (slow_headers: closed, its headers not in within header_timeout; "
                               "cap: answered 503, max_connections open)", ["reason"], registry=r)

    def drafted(self, model: str, proposed: int, accepted: int) -> None:
        self.draft_tokens.labels(model=model, outcome="proposed").inc(proposed)
        self.draft_tokens.labels(model=model, outcome="accepted").inc(accepted)
