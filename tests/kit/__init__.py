"""Test kits, one subject each: waiting, ranks, agents, configs, openai, sshd.
Ports come from meshd.meshctl.ports, the demo's own picker."""
