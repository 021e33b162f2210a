"""The NATS logins of a mesh `yinian up` starts: one user per service, each
allowed to publish only the subjects it owns and to read only those it uses (a
worker publishes its own load and KV events, not another's; only the scheduler
asks a worker to register; a gateway reads what placing needs), and one
operator user with every subject (for the mesh's owner: tools and tests).
Receivers also check that a message names the service its subject names
(services/common/bus.py): a login's allow-list and the message's contents
then agree."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from services.common.bus import (
    KV_RESYNC_SUBJECT,
    SHARED_KV_SUBJECT,
    expert_load_subject,
    kv_subject,
    load_subject,
    register_subject,
)

OPERATOR = "yinian"


@dataclass(frozen=True)
class Login:
    user: str
    password: str
    publish: tuple[str, ...] | None  # None: every subject (the operator)
    subscribe: tuple[str, ...] | None


def service_login(name: str) -> Login:
    """The login of the service a mesh names `name` (scheduler, kvstore, expert-N,
    or a worker: worker-N, prefill-N, decode-N)."""
    password = secrets.token_urlsafe(24)
    if name == "scheduler":
        publish = (register_subject(), KV_RESYNC_SUBJECT)
        subscribe = (load_subject(), kv_subject(), SHARED_KV_SUBJECT, expert_load_subject())
    elif name == "gateway" or name.startswith("gateway-"):  # it places requests itself
        publish = (KV_RESYNC_SUBJECT,)
        subscribe = (load_subject(), kv_subject(), SHARED_KV_SUBJECT)
    elif name == "kvstore":
        publish, subscribe = (SHARED_KV_SUBJECT,), (KV_RESYNC_SUBJECT,)
    elif name.startswith("expert-"):
        publish, subscribe = (expert_load_subject(name),), ()
    else:  # a worker, whatever its role
        publish = (load_subject(name), kv_subject(name), KV_RESYNC_SUBJECT)
        subscribe = (register_subject(name), SHARED_KV_SUBJECT, KV_RESYNC_SUBJECT)
    return Login(name, password, publish, subscribe)


def operator_login() -> Login:
    return Login(OPERATOR, secrets.token_urlsafe(24), None, None)


def server_config(logins: list[Login]) -> str:
    """nats-server's `authorization` block for these logins."""
    users = []
    for login in logins:
        entry = f"{{user: {json.dumps(login.user)}, password: {json.dumps(login.password)}"
        if login.publish is not None:
            entry += (
                f", permissions: {{publish: {{allow: {json.dumps(list(login.publish))}}}, "
                f"subscribe: {{allow: {json.dumps(list(login.subscribe or ()))}}}}}"
            )
        users.append(entry + "}")
    return "authorization {\n  users: [\n    " + ",\n    ".join(users) + "\n  ]\n}\n"


def url_of(login: Login, address: str) -> str:
    """nats://USER:PASSWORD@ADDRESS (the password is URL-safe)."""
    return f"nats://{login.user}:{login.password}@{address}"
