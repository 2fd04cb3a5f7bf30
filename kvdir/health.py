"""`kvdir health`: exit 0 if a component's health endpoint answers 2xx (container health checks).

Standard library only, on purpose: Docker runs it every few seconds in every container, and it must
answer well inside the check's timeout on a loaded host. Importing kvdir's settings (pydantic, FastAPI)
took ~1 s of CPU per probe; eight containers probing at once on a busy 2-core machine pushed probes past
the 3 s timeout and left healthy services "unhealthy".
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

DEFAULT_URL = "http://127.0.0.1:8100/health"
# The probe targets the container itself: never through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def probe(url: str, timeout: float) -> str | None:
    """None if `url` answers 2xx within `timeout` seconds, else why not."""
    try:
        with _OPENER.open(url, timeout=timeout) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code} from {url}"
    except (OSError, ValueError) as exc:  # refused, timed out, unresolvable, a malformed URL
        return f"{url}: {exc}"
    return None if 200 <= status < 300 else f"HTTP {status} from {url}"


def run_health(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="kvdir health", description="exit 0 if URL answers 2xx within the timeout (container health checks)"
    )
    p.add_argument(
        "--url",
        default=os.environ.get("KVDIR_HEALTH_URL", DEFAULT_URL),
        help="the endpoint to probe [env KVDIR_HEALTH_URL]",
    )
    p.add_argument("--timeout", type=float, default=2.0)
    args = p.parse_args(list(argv))
    problem = probe(args.url, args.timeout)
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(run_health(sys.argv[1:]))
