"""``python``: run the policy's code in a sandbox and return what it printed (docs/tools.md, "``python``").
What isolation a sandbox got is logged once and told to the policy; ``isolation="required"`` refuses less.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Optional

from stapo.tools.base import Tool, ToolError, ToolSession, register_tool
from stapo.tools.sandbox import Sandbox, SandboxLimits, SandboxStartError
from stapo.tools.sandbox_fusion import run_code

__all__ = ["PythonTool", "PythonSession", "isolation_holds", "isolation_summary", "sandbox_report"]

BACKENDS = ("local", "sandbox_fusion")
ISOLATION = ("auto", "required", "off")
_RESTARTED = "the interpreter was stopped: the next call starts a new one, without the variables of earlier calls"
log = logging.getLogger("stapo.tools")
_probes: dict = {}  # isolate -> the isolation a probe sandbox got (or {"start_error": why})
_reported: set = set()  # summaries already logged
_probe_lock = threading.Lock()

_LAYERS = (("network", "network namespace"), ("pid", "PID namespace"), ("read_only", "read-only file system"),
           ("seccomp", "seccomp"), ("subreaper", "subreaper"))
_WHY = ("landlock_error", "seccomp_error", "mount_error", "uid_error", "error")


def isolation_holds(isolation: dict) -> dict:
    """What a started sandbox's ``isolation`` keeps the code from, whichever layer does it (docs/tools.md,
    "What holds in each mode")."""
    landlock = isolation.get("landlock", 0)
    return {"network": bool(isolation.get("network") or isolation.get("seccomp")),
            "file system": bool(isolation.get("read_only") or landlock >= 1),
            "other processes": bool(isolation.get("pid") or landlock >= 6),
            "process count": "uid_error" not in isolation}


def isolation_summary(isolation: dict) -> str:
    """One line: the layers a started sandbox got, and what it is NOT isolated from (with why)."""
    have = [name for key, name in _LAYERS if isolation.get(key)]
    have += [f"Landlock ABI {isolation['landlock']}"] if isolation.get("landlock") else []
    have.append(f"uid {isolation.get('uid')}")
    if isolation.get("hidden"):
        have.append(f"hidden: {', '.join(isolation['hidden'])}")
    if isolation.get("writable_mounts"):
        have.append(f"still writable: {', '.join(isolation['writable_mounts'])}")
    lacking = [what for what, held in isolation_holds(isolation).items() if not held]
    why = "; ".join(str(isolation[key]) for key in _WHY if isolation.get(key))
    return ", ".join(have) + (f"; NOT isolated: {', '.join(lacking)}" if lacking else "") + (
        f" [{why}]" if why else "")


def _probe(isolate: bool) -> dict:
    """What a sandbox gets on this machine: one probe per process and setting, reported once."""
    with _probe_lock:
        if isolate not in _probes:
            try:
                with Sandbox(SandboxLimits(isolate=isolate)) as sandbox:
                    sandbox.start()
                    _probes[isolate] = sandbox.isolation
            except SandboxStartError as exc:
                _probes[isolate] = {"start_error": str(exc)}
    if "start_error" not in _probes[isolate]:
        _report(_probes[isolate])
    return _probes[isolate]


def _report(isolation: dict) -> None:
    """Log what a sandbox got the first time it is seen (whatever its uid; a warning when something is
    missing): once per process, and again only if a later sandbox gets less."""
    seen = isolation_summary({key: value for key, value in isolation.items() if key != "uid"})
    with _probe_lock:
        if seen in _reported:
            return
        _reported.add(seen)
    level = log.info if all(isolation_holds(isolation).values()) else log.warning
    level("python sandbox: %s", isolation_summary(isolation))


def sandbox_report() -> str:
    """``stapo tools``' line: what the python tool's sandbox gets on this machine."""
    found = _probe(True)
    if "start_error" in found:
        return f"python sandbox on this machine: cannot start ({found['start_error']})"
    return f"python sandbox on this machine: {isolation_summary(found)}"



class PythonSession:
    """One episode's interpreter (started at its first call); ``close()`` ends it."""

    def __init__(self, tool: "PythonTool"):
        self.tool, self.sandbox = tool, Sandbox(tool.limits, stateful=True)
        self._lock = threading.Lock()

    def run(self, code: str) -> str:
        with self._lock:
            return self.tool._run_local(self.sandbox, code, restarts=True)

    def close(self) -> None:
        self.sandbox.close()

    def __enter__(self) -> "PythonSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@register_tool("python")
@dataclass
class PythonTool(Tool):
    """Run Python code in a sandboxed process (limits, clean env, isolated where the OS allows); returns its output."""

    description = ("Run Python code and return what it prints (stdout and stderr; the value of a final "
                   "expression is printed too).")
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "Python source to run"}},
                  "required": ["code"], "additionalProperties": False}

    timeout_s: float = 10.0  # wall clock per call; past it the code and everything it started are killed
    max_output_chars: int = 2000  # printed characters returned; more is cut and the call is an error
    cpu_time_s: float = 10.0  # CPU seconds per call (RLIMIT_CPU, whole seconds)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    max_processes: int = 16  # processes + threads the code may run at once (RLIMIT_NPROC, see docs)
    file_size_mb: int = 16  # largest file and total size of the working directory
    stateful: bool = False  # one interpreter per episode (open_session), variables kept across calls
    isolation: str = "auto"  # every layer the OS allows; "required": refuse without the minimum; "off": limits only
    startup_timeout_s: float = 30.0  # for the interpreter to start (not counted in timeout_s)
    backend: str = "local"  # "local" or "sandbox_fusion" (a SandboxFusion service at url)
    url: str = ""  # SandboxFusion's base URL, e.g. http://sandbox:8080

    def __post_init__(self):
        super().__post_init__()
        if self.backend not in BACKENDS:
            raise ValueError(f"python tool: backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.isolation not in ISOLATION:
            raise ValueError(f"python tool: isolation must be one of {ISOLATION}, got {self.isolation!r}")
        if self.backend == "sandbox_fusion" and not self.url:
            raise ValueError("python tool: backend='sandbox_fusion' needs url (the service's base URL)")
        if self.backend == "sandbox_fusion" and self.stateful:
            raise ValueError("python tool: SandboxFusion's /run_code keeps no state between calls; "
                             "use stateful=False with backend='sandbox_fusion'")
        for name in ("cpu_time_s", "memory_mb", "max_processes", "file_size_mb", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"python tool: {name} must be > 0, got {getattr(self, name)!r}")
        local_required = self.backend == "local" and self.isolation == "required"
        missing = self._missing_isolation(_probe(True)) if local_required else ""
        if missing:  # at start (config validation, the trainer), not as an error in every episode
            raise ValueError(f"python tool: isolation='required' but this machine gives the sandbox no {missing}; "
                             "docs/tools.md, \"Threat model\", says what each mode needs")

    @property
    def limits(self) -> SandboxLimits:
        return SandboxLimits(self.timeout_s, self.cpu_time_s, self.memory_mb, self.max_processes,
                             self.file_size_mb, self.max_output_chars, self.startup_timeout_s,
                             isolate=self.isolation != "off")

    @property
    def deadline_s(self) -> float:
        return self.timeout_s + self.startup_timeout_s + 5.0

    def schema(self) -> dict:
        """The description tells the policy what this machine's sandbox really allows."""
        entry = super().schema()
        if self.backend == "local":
            holds = isolation_holds(_probe(self.limits.isolate))
            entry["function"]["description"] += (" No network access." if holds["network"] else
                                                 " Network access is not blocked.")
            entry["function"]["description"] += (" Files may be written in the working directory only."
                                                 if holds["file system"] else "")
        if self.stateful:
            entry["function"]["description"] += " Variables and imports persist across calls in this conversation."
        return entry

    def open_session(self) -> Optional[ToolSession]:
        return PythonSession(self) if self.stateful else None

    def run(self, arguments: dict, session: Optional[ToolSession]) -> str:
        code = arguments["code"]
        if self.backend == "sandbox_fusion":
            output, failed = run_code(self.url, code, self.timeout_s, self.memory_mb, self.limits.max_output_bytes)
            if failed:
                raise ToolError(output or "the code failed")
            return output
        if isinstance(session, PythonSession):
            return session.run(code)
        with Sandbox(self.limits) as sandbox:
            return self._run_local(sandbox, code, restarts=False)

    def _run_local(self, sandbox: Sandbox, code: str, restarts: bool) -> str:
        try:
            if not sandbox.alive:
                sandbox.start()
        except SandboxStartError as exc:
            raise ToolError(str(exc)) from None
        _report(sandbox.isolation)
        missing = self._missing_isolation(sandbox.isolation)
        if missing:
            sandbox.close()
            raise ToolError(f"python tool: isolation='required' but this sandbox got no {missing}; "
                            "docs/tools.md, \"Threat model\", says what each mode needs")
        result = sandbox.run(code)
        text = result.text
        if result.ended:
            text += f"{chr(10) if text else ''}{result.ended}" + (f"; {_RESTARTED}" if restarts else "")
        if result.error or result.ended or result.total_chars > self.max_output_chars:
            raise ToolError(text, total_chars=result.total_chars + len(text) - len(result.text))
        return text

    def _missing_isolation(self, isolation: dict) -> str:
        """What ``isolation='required'`` asks for and this sandbox lacks ('' when nothing): seccomp (no
        sockets, no new namespaces, no ptrace), isolation of the file system and of other processes by
        namespaces or Landlock, and a process limit that binds (docs/tools.md, "Threat model")."""
        if self.isolation != "required":
            return ""
        if "start_error" in isolation:
            return f"sandbox at all: {isolation['start_error']}"
        missing = [] if isolation.get("seccomp") else [f"seccomp filter ({isolation.get('seccomp_error', '')})"]
        holds = isolation_holds(isolation)
        missing += [what for key, what in (("file system", "file-system isolation (a mount namespace or Landlock)"),
                                           ("other processes", "process isolation (a PID namespace or Landlock "
                                                               "ABI >= 6)"),
                                           ("process count", "process limit (a uid of its own: CAP_SETUID)"))
                    if not holds[key]]
        return ", ".join(missing)
