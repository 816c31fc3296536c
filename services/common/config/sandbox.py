"""The code sandbox service (sandbox): where its replicas listen, how many programs each runs at once, and the
limits every program runs under (a request may lower them, or raise them up to the max_* keys)."""
from __future__ import annotations

from services.common.config.types import NonNegativeInt, Port, PositiveFloat, PositiveInt, config_section


@config_section
class SandboxConfig:
    """Sandbox replicas: each runs untrusted programs under bubblewrap with rlimits (docs/sandbox.md)."""

    host: str = "127.0.0.1"  # bind address
    grpc_port: Port = 50081  # gRPC port of the first replica (replica i: + i); the trainer has 50071
    replicas: PositiveInt = 1  # sandbox replicas of a run (`dockrl up` starts them when a client's sandbox_address is empty); each serves with its own --replica-index below this (its port and its uids follow from it)
    workers: PositiveInt = 4  # programs one replica runs at once
    queue: NonNegativeInt = 16  # programs that may wait for a worker; more is RESOURCE_EXHAUSTED
    interpreter: str = "/usr/bin/python3"  # the Python programs run with (the system's, not a venv); must lie under /usr or ro_paths
    ro_paths: tuple[str, ...] = ()  # extra host paths bound read-only at the same place (libraries a task may import)
    uid_base: PositiveInt = 61000  # a root server runs programs as unused host uids from here: replica r, worker i gets uid_base + r * workers + i (the process limit counts per uid)
    wall_s: PositiveFloat = 10.0  # wall-clock limit of one program; its CPU-time limit is the same number of seconds
    max_wall_s: PositiveFloat = 60.0  # the most a request may ask for as wall_s
    memory_mb: PositiveInt = 512  # address-space limit (RLIMIT_AS) of each process of a program
    max_memory_mb: PositiveInt = 4096  # the most a request may ask for as memory_mb
    output_bytes: PositiveInt = 1_048_576  # bytes of stdout and of stderr kept; a program writing more is stopped (output_limit)
    max_output_bytes: PositiveInt = 16_777_216  # the most a request may ask for as output_bytes
    processes: PositiveInt = 32  # processes and threads a program may have at once (RLIMIT_NPROC of its uid)
    file_size_mb: PositiveInt = 16  # largest file a program may write (RLIMIT_FSIZE)
    tmpfs_mb: PositiveInt = 64  # size of the program's only writable directory, /tmp (a fresh tmpfs)
    max_code_bytes: PositiveInt = 1_048_576  # bytes of source per program; more is INVALID_ARGUMENT
    max_stdin_bytes: PositiveInt = 16_777_216  # bytes of stdin per program; more is INVALID_ARGUMENT
    max_batch: PositiveInt = 256  # programs per ExecuteBatch request; more is INVALID_ARGUMENT
    max_request_mb: PositiveInt = 64  # gRPC receive limit for one request

    def port(self, replica_index: int) -> int:
        """The port replica `replica_index` serves on by default: grpc_port + the index."""
        return self.grpc_port + replica_index

    def address(self, index: int = 0) -> str:
        """host:port of the run's sandbox replica `index` (modulo replicas), as `dockrl up` starts them; the address
        a client takes when its own key (reward.sandbox_address, rollout.multi_turn.sandbox_address) is empty."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port(index % self.replicas)}"
