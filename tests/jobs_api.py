"""A workspace's Jobs API for one job run, served on 127.0.0.1, for the tests of ``dtlab.tooling.jobs``.

Databricks' ``GET /api/2.1/jobs/runs/get`` (and 2.2, which newer databricks-sdk versions call) with the run's JSON,
answering only requests that carry the token, as the workspace does; what the Databricks SDK sends is real.
"""

import json


class JobsAPI:
    """The workspace's Jobs API for one run, on 127.0.0.1 (``runs/get``, versions 2.1 and 2.2), answering only
    requests with ``token``."""

    def __init__(self, token: str, run: dict):
        import http.server
        import threading

        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                from urllib.parse import parse_qs, urlparse

                url = urlparse(self.path)
                if self.headers.get("Authorization") != f"Bearer {token}":
                    self._send(401, {"error_code": "UNAUTHENTICATED", "message": "Invalid access token."})
                elif url.path in ("/api/2.1/jobs/runs/get", "/api/2.2/jobs/runs/get") and \
                        parse_qs(url.query).get("run_id") == [str(run["run_id"])]:
                    api.calls += 1
                    self._send(200, run)
                else:
                    self._send(404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": self.path})

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.calls = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
