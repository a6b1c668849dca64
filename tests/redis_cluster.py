"""A local Redis Cluster for the tests: three masters on free loopback ports (``redis-server --cluster-enabled
yes``, joined by ``redis-cli --cluster create``, no replicas, ``cluster-require-full-coverage no`` so that the shards
left keep serving when one dies). Ferry connects as an ACL user with only :data:`common.keys.ACL_RULES`; the tests'
own clients are the default user."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from common import keys
from tests.helpers import free_port, wait_for

PASSWORD = "s3cret-for-cluster-tests"


@dataclass
class ThreeMasters:
    """A local Redis Cluster of three masters; each node's nodes.conf stays in its folder, so a killed master
    restarted on its port rejoins with its slots (and, without persistence, none of its data)."""

    workdir: Path
    ports: list[int] = field(default_factory=lambda: [free_port() for _ in range(3)])
    bus_ports: list[int] = field(default_factory=lambda: [free_port() for _ in range(3)])  # (default: port + 10000)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """Ferry's: its ACL user."""
        return f"redis://ferry:{PASSWORD}@127.0.0.1:{self.ports[0]}/0"

    def start(self, port: int) -> None:
        folder = self.workdir / str(port)
        folder.mkdir(exist_ok=True)
        with open(folder / "redis.log", "ab") as log:  # the child has its own copy of the descriptor
            self.procs[port] = subprocess.Popen(
                [shutil.which("redis-server") or "redis-server", "--bind", "127.0.0.1", "--port", str(port),
                 "--cluster-enabled", "yes", "--cluster-port", str(self.bus_ports[self.ports.index(port)]),
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                 "--cluster-require-full-coverage", "no", "--save", "", "--appendonly", "no", "--dir", str(folder),
                 "--user", "ferry", "on", f">{PASSWORD}", *keys.ACL_RULES.split()],
                stdout=log, stderr=subprocess.STDOUT,
            )
        node = redis.Redis(port=port)
        wait_for(lambda: self._answers(node), 10, f"redis-server on {port}")

    @staticmethod
    def _answers(node: redis.Redis) -> bool:
        try:
            return bool(node.ping())
        except redis.ConnectionError:
            return False

    def kill(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait()

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.ports[0])

    def owner(self, name: str) -> int:
        """The port of the master that owns the slot of a key or channel name."""
        return int(self.client().get_node_from_key(name).port)

    def healthy(self) -> bool:
        infos = [redis.Redis(port=port).cluster("info") for port in self.ports]
        return all(info["cluster_state"] == "ok" and int(info["cluster_known_nodes"]) == 3 for info in infos)


@contextlib.contextmanager
def three_masters(workdir: Path) -> Iterator[ThreeMasters]:
    """A cluster made in ``workdir`` for the ``with`` block (its processes killed after it)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        message = "redis-server and redis-cli are needed for the Redis Cluster tests"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    cluster = ThreeMasters(workdir)
    try:
        for port in cluster.ports:
            cluster.start(port)
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in cluster.ports),
             "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert created.returncode == 0, created.stdout + created.stderr
        wait_for(cluster.healthy, 30, "the cluster to agree on its slots")
        yield cluster
    finally:
        for proc in cluster.procs.values():
            proc.kill()
            proc.wait()
