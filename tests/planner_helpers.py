"""What the planner tests share: the committed capacity profile, and a stand-in
gateway whose /metrics page a test writes."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from paths import ROOT

PROFILE = ROOT / "bench/results/planner_up/profile-sweep.json"


def gateway_page(page) -> HTTPServer:
    """An HTTP server whose /metrics is what `page()` gives (a gateway's page)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = page()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
