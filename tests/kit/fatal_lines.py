"""The lines ranks print when they die, as the transports (ring, JACCL, NCCL),
CUDA and Metal print them, with the signature, severity and role each must get;
and two lines that are no signature."""

LINES = [
    ("[jaccl] Recv failed with errno=12 (-12)", "jaccl_enomem", "fatal", "cause"),
    ("ValueError: [jaccl] Send failed with error code -12", "jaccl_enomem", "fatal", "cause"),
    ("libc++abi: terminating: [jaccl] Send failed: ibv_post_send returned -12", "jaccl_enomem", "fatal", "cause"),
    ("ValueError: [jaccl] Send failed with error code -5", "jaccl_post_failed", "fatal", "cause"),
    ("RuntimeError: [jaccl] ibv_poll_cq failed", "jaccl_poll_failed", "fatal", "cause"),
    ("[jaccl] RDMA work completion error: status=12 (transport retry counter exceeded)", "jaccl_work_completion",
     "fatal", "cause"),
    ("[jaccl] Recv failed with errno=2", "jaccl_peer_gone_at_init", "fatal", "consequence"),
    ("RuntimeError: [jaccl] Couldn't connect (error: 60)", "tcp_connect_failed", "fatal", "consequence"),
    ("[jaccl] Couldn't allocate protection domain", "jaccl_protection_domain", "reboot", "cause"),
    ("ValueError: [jaccl] Changing queue pair to RTR failed with errno 16", "jaccl_rtr_stale", "reboot", "cause"),
    ("ValueError: [jaccl] Changing queue pair to RTR failed with errno 96", "jaccl_rtr", "fatal", "cause"),
    ("Segmentation fault in tbt_post_recv+0x44", "jaccl_tbt_post_recv_crash", "reboot", "cause"),
    ("[ring] Sending to socket 4 failed with errno 32", "ring_send_failed", "fatal", "consequence"),
    ("[ring] Receiving from socket 4 failed with errno 104", "ring_send_failed", "fatal", "consequence"),
    ("RuntimeError: [ring] connection to a peer was lost", "ring_peer_lost", "fatal", "consequence"),
    ("[ring] Socket 3 was closed by the peer", "ring_peer_closed", "fatal", "consequence"),
    ("[ring] Too many send/recv errors. Failing pending tasks...", "ring_too_many_errors", "fatal", "consequence"),
    ("NCCL error /project/mlx/distributed/nccl/nccl.cpp:230 'invalid usage (run with NCCL_DEBUG=WARN for details)'",
     "nccl_invalid_usage", "fatal", "cause"),
    ("NCCL error /project/mlx/distributed/nccl/nccl.cpp:251 'unhandled system error (run with NCCL_DEBUG=INFO "
     "for details)'", "nccl_system_error", "fatal", "cause"),
    ("NCCL error /project/mlx/distributed/nccl/nccl.cpp:251 'remote process exited or there was a network error'",
     "nccl_remote_exited", "fatal", "consequence"),
    ("CUDA error /project/mlx/backend/cuda/allocator.cpp:89 'out of memory'", "cuda_error", "fatal", "cause"),
    ("[METAL] Command buffer execution failed: Caused GPU Timeout Error "
     "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)", "metal_gpu_timeout", "fatal", "cause"),
    ("[METAL] Command buffer execution failed: Insufficient Memory "
     "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)", "metal_out_of_memory", "fatal", "cause"),
    ("runtime.lockstep.Divergence: [meshd] divergence: the ranks sampled different tokens; digests by rank "
     "[1804289383, 846930886] at step 12", "divergence", "fatal", "cause"),
    ("runtime.lockstep.PeerLost: [meshd] lost a peer: the lockstep exchange came back with tally 0x1, not 0x3 "
     "(a rank missing from it)", "lockstep_peer_lost", "fatal", "consequence"),
    ("[meshd-rank g1 r0] loading 3/3", None, None, None),
    ("INFO request finished in 12.0s", None, None, None),
]
