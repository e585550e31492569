"""The ``python`` tool's remote backend: SandboxFusion's ``POST {url}/run_code`` (docs/tools.md, "The
SandboxFusion backend"). ``urllib``: an option, not a dependency; the service keeps no state, so no sessions.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from stapo.tools.base import ToolError

__all__ = ["run_code"]

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def run_code(url: str, code: str, timeout_s: float, memory_mb: int, max_response_bytes: int) -> tuple[str, bool]:
    """``(output, failed)`` of ``code`` run by the service at ``url``; ``ToolError`` when the
    service cannot be reached, answers an HTTP error or something that is not its JSON."""
    body = json.dumps({"code": code, "language": "python", "run_timeout": timeout_s,
                       "memory_limit_MB": memory_mb}).encode()
    request = urllib.request.Request(url.rstrip("/") + "/run_code", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:  # the service enforces run_timeout; the request allows for its queue and start-up on top
        with _OPENER.open(request, timeout=timeout_s + 30) as response:
            raw = response.read(max_response_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise ToolError(f"the sandbox service at {url} answered HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ToolError(f"the sandbox service at {url} could not be reached: {reason}") from None
    if len(raw) > max_response_bytes:
        raise ToolError(f"the sandbox service's answer is larger than {max_response_bytes} bytes", max_response_bytes)
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or answer.get("status") not in ("Success", "Failed", "SandboxError"):
        raise ToolError(f"the sandbox service at {url} answered something that is not SandboxFusion's JSON")
    run = answer.get("run_result") or {}
    output = (run.get("stdout") or "") + (run.get("stderr") or "")
    if answer["status"] == "SandboxError":
        raise ToolError(f"{output}sandbox service error: {answer.get('message') or run.get('status')}".strip())
    if run.get("status") == "TimeLimitExceeded":
        output += f"{chr(10) if output else ''}timed out after {timeout_s:g} s (the wall-clock limit)"
    return output, answer["status"] != "Success"
