"""The fatal lines ranks print, and what each means.

`fatal`: the generation is dead (restart it). `reboot`: this node holds
resources only a reboot frees (queue pairs, protection domains, wired memory).
Lines come from the field's reports and from mlx's transports (ring, JACCL, NCCL, Metal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FATAL, REBOOT = "fatal", "reboot"


@dataclass(frozen=True)
class Signature:
    name: str
    severity: str
    pattern: re.Pattern


SIGNATURES: tuple[Signature, ...] = tuple(
    Signature(name, severity, re.compile(pattern))
    for name, severity, pattern in (
        ("jaccl_protection_domain", REBOOT, r"[Cc]ouldn't allocate protection domain"),
        ("jaccl_tbt_post_recv_crash", REBOOT, r"tbt_post_recv"),
        ("jaccl_enomem", FATAL, r"\[jaccl\].*(Send|Recv) failed.*(-12\b|errno\s*=?\s*12\b)"),
        ("jaccl_rtr", FATAL, r"\[jaccl\].*RTR.*errno\s*=?\s*(16|60|96)\b"),
        ("jaccl_errno", FATAL, r"\[jaccl\].*(Send|Recv|failed).*errno"),
        ("ring_send_failed", FATAL, r"\[ring\] (Sending to|Receiving from) socket \d+ failed with errno"),
        ("ring_peer_lost", FATAL, r"\[ring\] connection to a peer was lost"),
        ("ring_too_many_errors", FATAL, r"Too many send/recv errors"),
        ("metal_gpu_timeout", FATAL, r"\[METAL\] Command buffer execution failed.*Timeout"),
        ("metal_out_of_memory", FATAL, r"\[METAL\] Command buffer execution failed.*Insufficient Memory"),
        ("nccl_error", FATAL, r"NCCL (error|WARN).*(unhandled|remote process exited|Connection closed)"),
    )
)


def classify(line: str) -> Signature | None:
    """The first signature the line matches, or None."""
    for sig in SIGNATURES:
        if sig.pattern.search(line):
            return sig
    return None
