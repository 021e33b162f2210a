"""A `python -m services.kvstore` process for tests, and a NATS client on a
thread of its own that records what is published and publishes for the test."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict

import nats

from services.common.processes import stop_process
from services.kvstore import block_key

# the stores of a test run share one block key, as a mesh's do (they read each other's
# blocks in Redis, and a restarted store reads what the one before it wrote)
BLOCK_KEY = block_key.new_key()


class KvStoreProcess:
    def __init__(self, nats_url: str, redis_url: str = "", *flags: str):
        # port 0: the store binds any free port and names it in its ready line
        self.port = self.metrics_port = 0
        argv = ["--port", "0", "--nats-url", nats_url, "--metrics-port", "0", *flags]
        if redis_url:
            argv += ["--redis-url", redis_url]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.kvstore", *argv],
            env={**os.environ, block_key.ENV: BLOCK_KEY},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("READY kvstore"):  # READY kvstore HOST:PORT metrics HOST:PORT
                words = line.split()
                self.port = int(words[2].rsplit(":", 1)[-1])
                self.metrics_port = int(words[4].rsplit(":", 1)[-1])
                self.ready.set()

    def wait_ready(self, timeout: float = 30.0) -> KvStoreProcess:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvstore did not start:\n" + "".join(self.lines))
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        stop_process(self.proc)


class NatsRecorder:
    def __init__(self, url: str, subjects: dict[str, type]):
        self.received: dict[str, list] = defaultdict(list)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self._run(self._connect(url, subjects))

    def _run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self, url: str, subjects: dict[str, type]) -> None:
        self.nc = await nats.connect(url)
        for subject, message_type in subjects.items():

            async def on_message(msg, subject=subject, message_type=message_type):
                parsed = message_type()
                parsed.ParseFromString(msg.data)
                self.received[subject].append(parsed)

            await self.nc.subscribe(subject, cb=on_message)
        await self.nc.flush()

    def publish(self, subject: str, message) -> None:
        async def send():
            await self.nc.publish(subject, message.SerializeToString())
            await self.nc.flush()

        self._run(send())

    def wait_for(self, subject: str, predicate, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in list(self.received[subject]):
                if predicate(message):
                    return message
            time.sleep(0.02)
        raise AssertionError(f"nothing matching on {subject}: {self.received[subject]}")

    def close(self) -> None:
        self._run(self.nc.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
