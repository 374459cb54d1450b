"""A throwaway RabbitMQ node a test may configure, stop and kill (``ThrowawayRabbitMQ``).

Server settings such as ``consumer_timeout`` are the node's own, so a test that needs a short
one runs a node of its own, never the machine's: ``rabbitmq-server`` under a temporary
directory (its database, logs and pid file), on free AMQP and distribution ports, with no
config file and no plugins, removed by ``destroy()``. It registers its name with the
machine's ``epmd`` (one ``epmd`` serves every node of a host; the name is unique) and shares
the ``rabbitmq`` account's Erlang cookie, so ``rabbitmqctl -n <node>`` reaches it. As root,
the package's wrapper scripts run the server and ``rabbitmqctl`` as ``rabbitmq``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

from celery_resilient.testing.services import free_port
from celery_resilient.testing.waiting import wait_for

#: The distribution port of a node started by the package (``rabbit@host``): never ours.
MACHINE_DIST_PORT = 25672


def _sbin(name: str) -> str:
    found = shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists()
                                   else None)
    if found is None:
        raise RuntimeError(f"{name} not found: install the RabbitMQ server")
    return found


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports and port != MACHINE_DIST_PORT:
            ports.append(port)
    return ports


class ThrowawayRabbitMQ:
    """A ``rabbitmq-server`` node of its own; ``consumer_timeout`` in seconds (None: the
    server's default, 30 minutes), checked every ``tick_interval`` seconds (the channel tick:
    RabbitMQ's default of 60 s would let a short timeout pass unnoticed for a minute)."""

    def __init__(self, consumer_timeout: float | None = 8.0, tick_interval: float = 1.0,
                 start_timeout: float = 60.0) -> None:
        self.server = _sbin("rabbitmq-server")
        self.ctl_binary = _sbin("rabbitmqctl")
        self.dir = Path(tempfile.mkdtemp(prefix="resilient-rabbitmq-", dir="/tmp"))
        self.name = f"resilient-{uuid.uuid4().hex[:10]}"
        self.node = f"{self.name}@localhost"
        self.port, self.dist_port = _free_ports(2)
        self.consumer_timeout = consumer_timeout
        self.tick_interval = tick_interval
        self.start_timeout = start_timeout
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        self.log = self.dir / "log" / f"{self.node}.log"
        self.pid_file = self.dir / "rabbitmq.pid"
        self.proc: subprocess.Popen[bytes] | None = None
        plugins = self.dir / "enabled_plugins"
        plugins.write_text("[].\n")
        if os.geteuid() == 0:  # the wrapper scripts run the server as rabbitmq
            for path in (self.dir, plugins):
                shutil.chown(path, "rabbitmq")

    def _env(self) -> dict[str, str]:
        erl_args = [f"-rabbit channel_tick_interval {int(self.tick_interval * 1000)}",
                    "-rabbit loopback_users []"]  # guest from 127.0.0.1 needs no exception
        if self.consumer_timeout is not None:
            erl_args.insert(0, f"-rabbit consumer_timeout {int(self.consumer_timeout * 1000)}")
        return {
            **os.environ,
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_PID_FILE": str(self.pid_file),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            # paths that do not exist: the machine's rabbitmq.conf and advanced.config unread
            "RABBITMQ_CONFIG_FILE": str(self.dir / "none"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "none.config"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": " ".join(erl_args),
        }

    def start(self) -> ThrowawayRabbitMQ:
        """Start the node and wait (with a deadline) until it accepts AMQP connections."""
        if self.running():
            raise RuntimeError(f"RabbitMQ node {self.node} is already running")
        with (self.dir / "server.out").open("ab") as out:
            self.proc = subprocess.Popen([self.server], stdout=out, stderr=subprocess.STDOUT,
                                         env=self._env(), cwd="/", start_new_session=True)

        def listening() -> bool:
            if not self.running():
                raise RuntimeError(f"rabbitmq-server {self.node} exited during start:\n"
                                   f"{self.output()[-4000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                return False

        wait_for(listening, self.start_timeout, f"RabbitMQ node {self.node} on port "
                 f"{self.port}", interval=0.2)
        # the listener opens late in the boot; await_startup confirms the boot completed
        self.ctl("await_startup", "--timeout", str(int(self.start_timeout)))
        return self

    def ctl(self, *argv: str, timeout: float = 60.0) -> str:
        """``rabbitmqctl -n <node> <argv>``; its output (raises when it fails)."""
        done = subprocess.run([self.ctl_binary, "-q", "-n", self.node, *argv], check=False,
                              capture_output=True, timeout=timeout, cwd="/")
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(argv)} on {self.node} failed "
                               f"({done.returncode}): {done.stderr.decode(errors='replace')}")
        return done.stdout.decode(errors="replace")

    def queues(self, vhost: str = "/") -> dict[str, tuple[int, int]]:
        """Each queue of ``vhost``: (messages ready, messages unacknowledged)."""
        text = self.ctl("list_queues", "-p", vhost, "--no-table-headers", "name",
                        "messages_ready", "messages_unacknowledged")
        found: dict[str, tuple[int, int]] = {}
        for line in text.splitlines():
            parts = line.split("\t")
            if len(parts) == 3:
                found[parts[0]] = (int(parts[1]), int(parts[2]))
        return found

    def queue_counts(self, name: str, vhost: str = "/") -> tuple[int, int]:
        """Queue ``name``'s (messages ready, messages unacknowledged); (0, 0) if it is absent."""
        return self.queues(vhost).get(name, (0, 0))

    def log_text(self) -> str:
        """The node's log so far."""
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def output(self) -> str:
        """What ``rabbitmq-server`` printed (its banner, or why it did not start)."""
        try:
            return (self.dir / "server.out").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _beam_pid(self) -> int | None:
        """The node's Erlang VM, if it runs (its pid file, checked: a pid may be reused)."""
        try:
            pid = int(self.pid_file.read_text().strip())
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (OSError, ValueError):
            return None
        return pid if f"RABBITMQ_NODENAME={self.node}".encode() in environ.split(b"\0") \
            else None

    def kill(self) -> None:
        """SIGKILL: the node vanishes the hard way (the Erlang VM, then the scripts)."""
        beam = self._beam_pid()
        if beam is not None:
            # the VM runs in the session su opened for it, with its launching scripts
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(beam), signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> None:
        """A clean stop (``rabbitmqctl stop``); SIGKILL if it does not end in ``timeout``."""
        if not self.running():
            return
        try:
            self.ctl("stop", timeout=timeout)
            assert self.proc is not None
            self.proc.wait(timeout=timeout)
        except (RuntimeError, subprocess.TimeoutExpired):
            self.kill()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["ThrowawayRabbitMQ"]
