"""The NATS event plane: load reports and KV events, as protobuf messages
with the trace context in the headers. Nothing on this plane is needed to
finish a request already placed, so publishing never blocks or fails a request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats
from google.protobuf.message import Message

from basis import urls
from services.common.telemetry import nats_headers

logger = logging.getLogger(__name__)

SUBJECT_PREFIX = "yinian"


def load_subject(worker_id: str = "*") -> str:
    return f"{SUBJECT_PREFIX}.load.{worker_id}"


def kv_subject(worker_id: str = "*") -> str:
    """A worker's KvEvents."""
    return f"{SUBJECT_PREFIX}.kv.{worker_id}"


def register_subject(worker_id: str = "*") -> str:
    """The scheduler asks a worker it does not know (it restarted, or dropped the
    worker while NATS was down) to register again; the message is empty."""
    return f"{SUBJECT_PREFIX}.register.{worker_id}"


def expert_load_subject(expert_id: str = "*") -> str:
    """An expert service's ExpertLoad reports (its heartbeat, with counts in windows)."""
    return f"{SUBJECT_PREFIX}.expertload.{expert_id}"


# Not under `kv.` (a subscriber to kv.* must only ever see KvEvents).
KV_RESYNC_SUBJECT = f"{SUBJECT_PREFIX}.kvresync"  # KvResync requests
SHARED_KV_SUBJECT = f"{SUBJECT_PREFIX}.kvshared"  # SharedKvEvents of the KV store


class EventBus:
    def __init__(self, url: str, name: str):
        # a deployment's NATS password comes from a secret of its own (basis/urls.py)
        self.url = urls.with_login(url, urls.NATS_PASSWORD_ENV, urls.NATS_USER)
        self.name = name
        self.nc: nats.NATS | None = None

    async def connect(self, timeout: float = 10.0) -> None:
        self.nc = await nats.connect(
            self.url,
            name=self.name,
            connect_timeout=timeout,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=self._on_error,
        )

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def _on_error(self, exc: Exception) -> None:
        logger.debug("nats: %s", exc)

    async def publish(self, subject: str, message: Message) -> None:
        if not self.connected:
            return
        try:
            await self.nc.publish(subject, message.SerializeToString(), headers=nats_headers())
        except Exception as exc:  # the event plane is best effort
            logger.debug("publish to %s failed: %s", subject, exc)

    async def subscribe(
        self,
        subject: str,
        message_type: type[Message],
        handler: Callable[[Message, dict], Awaitable[None] | None],
        subject_of: Callable[[Message], str] | None = None,
    ) -> None:
        """Calls `handler` with each message on `subject`; with `subject_of` (the subject
        a message must come on, from what it says: its worker's own subject, say), one
        that names another service than its subject does is dropped and logged: a
        login may publish on its own subjects only, so a message can speak only for
        its sender."""

        async def on_message(msg) -> None:
            parsed = message_type()
            try:
                parsed.ParseFromString(msg.data)
            except Exception:
                logger.warning("dropping malformed message on %s", msg.subject)
                return
            if subject_of is not None and subject_of(parsed) != msg.subject:
                logger.warning("dropping a message on %s that speaks for %s", msg.subject,
                               subject_of(parsed))  # fmt: skip
                return
            result = handler(parsed, msg.headers or {})
            if asyncio.iscoroutine(result):
                await result

        await self.nc.subscribe(subject, cb=on_message)

    async def close(self) -> None:
        if self.nc is not None:
            try:
                await self.nc.drain()
            except Exception:
                pass
            self.nc = None
