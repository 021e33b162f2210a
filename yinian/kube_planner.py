"""`yinian planner`: the SLA planner (services/scheduler/planner.py) scales a worker
Deployment on Kubernetes, as `yinian up --planner-profile` scales the workers of
this machine.

Every `--planner-interval` seconds it reads what the gateways' own `/metrics` saw
(`--gateway`, each gateway's URL, or `--gateway-selector`, the ready pods with
those labels, listed afresh each interval) and the Deployment's
ready replicas, asks the planner how many workers the next interval needs and
sets the Deployment's replicas to that (kr8s: a merge patch of `spec.replicas`,
the same change as `kubectl scale`). More replicas are pods Kubernetes starts (a
worker registers with the scheduler once it is up); fewer are pods it stops with
SIGTERM, on which a worker drains its streams within the pod's grace period. It
scales up past what is serving and starting, and down only below what is
serving: a pod still starting was asked for by an earlier decision. Each decision
is a line of JSON in `--decisions` (the planner's log).

Its credentials: in a pod, the pod's service account (it needs get, list and
patch on deployments, and list on pods with --gateway-selector, in its namespace:
deploy/k8s/components/planner); elsewhere,
the current context of the kubeconfig; `--kube-url` names an API server directly
(no authentication: `kubectl proxy`'s address, say)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from basis.flags import DefaultsFormatter
from yinian.autoscale import Autoscaler, GatewayWindow, add_autoscale_args, planner_of

logger = logging.getLogger("yinian.planner")


class DeploymentWorkers:
    """The actuator on Kubernetes: one Deployment's replicas."""

    def __init__(self, name: str, namespace: str, say: Callable[[str], None], api):
        self.name, self.namespace, self.say, self.api = name, namespace, say, api
        self.deployment = self._get()

    def _get(self):
        """The Deployment, read once: one that is not there is said at once (kr8s's own
        `Deployment.get` asks again for two seconds, for objects about to be created)."""
        from kr8s.objects import Deployment

        # the same query as kr8s's Deployment.get (a selector of the name: without one kr8s
        # ends its own with a comma)
        found = list(self.api.get(Deployment, self.name, namespace=self.namespace,
                                  field_selector={"metadata.name": self.name}))  # fmt: skip
        if not found:
            raise ValueError(f"no Deployment {self.name} in namespace {self.namespace}")
        return found[0]

    def _status(self) -> tuple[int, int]:
        """(spec.replicas, status.readyReplicas), read afresh."""
        self.deployment.refresh()
        raw = self.deployment.raw
        ready = raw.get("status", {}).get("readyReplicas") or 0
        return int(raw["spec"].get("replicas", 1)), int(ready)

    def serving(self) -> int:
        """Replicas ready now."""
        return self._status()[1]

    def count(self) -> int:
        """Replicas asked for (serving or starting)."""
        return self._status()[0]

    def scale_to(self, wanted: int) -> None:
        self.deployment.scale(wanted)
        self.say(f"planner: deployment/{self.name} scaled to {wanted}")


def gateway_pods(api, namespace: str, selector: str, port: int) -> Callable[[], list[str]]:
    """The base URLs of the ready pods `selector` picks, listed afresh at each call."""

    from kr8s.objects import Pod  # a class, not a name: no API discovery to find it

    def urls() -> list[str]:
        found = []
        for pod in api.get(Pod, namespace=namespace, label_selector=selector):
            status = pod.raw.get("status", {})
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in status.get("conditions", []))  # fmt: skip
            if ready and status.get("podIP"):
                found.append(f"http://{status['podIP']}:{port}")
        return sorted(found)

    return urls


def _run(args) -> int:
    if not args.planner_profile:
        raise ValueError("give --planner-profile: one worker's capacity (a bench serve sweep)")
    if bool(args.gateway) == bool(args.gateway_selector):
        raise ValueError("give the gateways either as --gateway URLs or by --gateway-selector")
    planner = planner_of(args)
    import kr8s

    api = kr8s.api(url=args.kube_url) if args.kube_url else kr8s.api()
    workers = DeploymentWorkers(args.deployment, args.namespace, logger.warning, api)
    gateways = args.gateway or gateway_pods(api, args.namespace, args.gateway_selector,
                                            args.gateway_port)  # fmt: skip
    scaler = Autoscaler(planner, GatewayWindow(gateways), workers, Path(args.decisions),
                        logger.warning)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.warning("planner: scaling deployment/%s in %s every %.0f s", args.deployment,
                   args.namespace, planner.config.interval)  # fmt: skip
    scaler.run(stop)
    return 0


def add_planner_parser(sub) -> None:
    p = sub.add_parser(
        "planner",
        help="the SLA planner scaling a worker Deployment on Kubernetes",
        description=__doc__,
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("--gateway", action="append", metavar="URL",
                   help="a gateway's base URL whose /metrics the planner reads; repeat for "
                   "each gateway (a Service in front of several reads one at random)")  # fmt: skip
    p.add_argument("--gateway-selector", metavar="LABELS",
                   help="instead: the gateways are the ready pods with these labels in the "
                   "Deployment's namespace (app.kubernetes.io/name=yinian-gateway)")  # fmt: skip
    p.add_argument("--gateway-port", type=int, default=8000,
                   help="the gateway pods' HTTP port (with --gateway-selector)")  # fmt: skip
    p.add_argument("--deployment", default="yinian-worker", help="the Deployment to scale")
    p.add_argument("--namespace", default="default", help="the Deployment's namespace")
    p.add_argument("--kube-url", help="the API server's URL (default: in-cluster or kubeconfig)")
    p.add_argument("--decisions", default="planner.jsonl", help="where each decision is written")
    add_autoscale_args(p)
    p.set_defaults(func=_run)
