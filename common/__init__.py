"""The bottom layer that the rank, the agent and the controller all stand on:
the wire protocol and its states, the status file, HTTP helpers and the error
shape, TOML checking, mlx hostfiles, systemd's notify protocol and the process
verbs. It imports nothing of the project."""
