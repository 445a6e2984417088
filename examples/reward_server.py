#!/usr/bin/env python3
"""A reward server for `dppo run --set reward.url=http://127.0.0.1:PORT/get_reward`.

It speaks OpenRLHF's remote reward protocol, so a server written for OpenRLHF works with
dppo unchanged: POST {"query": [...], "prompts": [...], "labels": [...]} (dppo also sends
"completions", "data_sources" and "extra_info"), answer {"rewards": [...], "extra_logs":
{...}}. The reward here is exact match of the completion's last number against the label,
plus 0.1 for the `Answer: N` format; both parts are logged (reward/exact/mean,
reward/format/mean). Standard library only.

    python3 examples/reward_server.py --port 8000 [--token-env REWARD_TOKEN]

With --token-env, requests must carry `Authorization: Bearer <the variable's value>`.
The first line on stdout is `listening on PORT` (use --port 0 for a free port).
"""

import argparse
import json
import os
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FORMAT = re.compile(r"^\s*Answer:\s*-?\d+\s*$")


def score(completion, label):
    """(exact, format) for one completion."""
    numbers = NUMBER.findall(completion)
    try:
        exact = float(numbers[-1]) == float(label) if numbers else False
    except (TypeError, ValueError):
        exact = False
    return float(exact), float(bool(FORMAT.match(completion)))


def rewards(body):
    """The answer to one request body."""
    # dppo sends the completions on their own; OpenRLHF clients send only the query.
    completions = body.get("completions") or body["query"]
    parts = [score(c, label) for c, label in zip(completions, body["labels"])]
    return {
        "rewards": [exact + 0.1 * fmt for exact, fmt in parts],
        "extra_logs": {
            "exact": [exact for exact, _ in parts],
            "format": [fmt for _, fmt in parts],
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--token-env", help="environment variable holding the bearer token")
    args = parser.parse_args()
    token = os.environ[args.token_env] if args.token_env else None

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                return self.reply(401, {"error": "missing or wrong bearer token"})
            length = int(self.headers.get("Content-Length", 0))
            try:
                body = json.loads(self.rfile.read(length))
                answer = rewards(body)
            except (ValueError, KeyError, TypeError) as e:
                return self.reply(400, {"error": f"bad request: {e}"})
            self.reply(200, answer)

        def reply(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"listening on {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
