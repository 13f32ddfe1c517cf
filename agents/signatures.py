"""The fatal lines ranks print, and what each means.

Severity `fatal`: the generation is dead (restart it). `reboot`: this node
holds resources only a reboot frees (queue pairs, protection domains, wired
memory). Role `cause`: this rank failed by itself. `consequence`: this rank
lost a peer (a socket closed, a remote process exited), so the root cause is
that peer's; the controller lists such lines under the rank that died first.

The lines are what mlx's transports (ring, JACCL, NCCL), Metal and CUDA print,
in the forms the field has reported them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.states import Role, Severity

FATAL, REBOOT = Severity.FATAL, Severity.REBOOT
CAUSE, CONSEQUENCE = Role.CAUSE, Role.CONSEQUENCE


@dataclass(frozen=True)
class Signature:
    name: str
    severity: Severity
    role: Role
    pattern: re.Pattern


SIGNATURES: tuple[Signature, ...] = tuple(
    Signature(name, severity, role, re.compile(pattern))
    for name, severity, role, pattern in (
        # JACCL (RDMA over Thunderbolt)
        ("jaccl_protection_domain", REBOOT, CAUSE, r"[Cc]ouldn't allocate protection domain"),
        ("jaccl_tbt_post_recv_crash", REBOOT, CAUSE, r"tbt_post_recv"),
        ("jaccl_rtr_stale", REBOOT, CAUSE, r"\[jaccl\].*RTR failed with errno\s*=?\s*16\b"),
        ("jaccl_rtr", FATAL, CAUSE, r"\[jaccl\].*RTR failed with errno\s*=?\s*\d+"),
        ("jaccl_peer_gone_at_init", FATAL, CONSEQUENCE, r"\[jaccl\].*(Send|Recv) failed with errno\s*=?\s*2\b"),
        ("jaccl_enomem", FATAL, CAUSE, r"\[jaccl\].*(Send|Recv) failed.*(-12\b|errno\s*=?\s*12\b)"),
        ("jaccl_post_failed", FATAL, CAUSE, r"\[jaccl\].*(Send|Recv) failed with error code -?\d+"),
        ("jaccl_poll_failed", FATAL, CAUSE, r"ibv_poll_cq failed"),
        ("jaccl_work_completion", FATAL, CAUSE, r"(?i)work completion error"),
        ("jaccl_errno", FATAL, CAUSE, r"\[jaccl\].*(Send|Recv|failed).*errno"),
        ("tcp_connect_failed", FATAL, CONSEQUENCE, r"\[(jaccl|ring|ibv)\] Couldn't connect \(error: \d+\)"),
        # ring (TCP)
        ("ring_send_failed", FATAL, CONSEQUENCE, r"\[ring\] (Sending to|Receiving from) socket \d+ failed with errno"),
        ("ring_peer_lost", FATAL, CONSEQUENCE, r"\[ring\] connection to a peer was lost"),
        ("ring_peer_closed", FATAL, CONSEQUENCE, r"\[ring\] Socket \d+ was closed by the peer"),
        ("ring_too_many_errors", FATAL, CONSEQUENCE, r"Too many send/recv errors"),
        # NCCL and CUDA (mlx[cuda])
        ("nccl_remote_exited", FATAL, CONSEQUENCE, r"NCCL.*remote process exited"),
        ("nccl_connect_failed", FATAL, CONSEQUENCE, r"\[Rank \d+\] connect\(\) failed after \d+ retries"),
        ("nccl_invalid_usage", FATAL, CAUSE, r"NCCL error.*invalid usage"),
        ("nccl_system_error", FATAL, CAUSE, r"NCCL error.*unhandled (system|cuda) error"),
        ("nccl_error", FATAL, CAUSE, r"NCCL (error|WARN).*(unhandled|Connection closed)"),
        ("cuda_error", FATAL, CAUSE, r"CUDA error .*:\d+ '"),
        # meshd-rank's own lockstep checks
        ("lockstep_peer_lost", FATAL, CONSEQUENCE, r"\[meshd\] lost a peer: the lockstep exchange"),
        ("divergence", FATAL, CAUSE, r"\[meshd\] divergence: the ranks sampled different tokens"),
        # Metal
        ("metal_gpu_timeout", FATAL, CAUSE, r"\[METAL\] Command buffer execution failed.*Timeout"),
        ("metal_out_of_memory", FATAL, CAUSE, r"\[METAL\] Command buffer execution failed.*Insufficient Memory"),
    )
)


def classify(line: str) -> Signature | None:
    """The first signature the line matches, or None."""
    for sig in SIGNATURES:
        if sig.pattern.search(line):
            return sig
    return None
