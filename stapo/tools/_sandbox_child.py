"""The sandbox's launcher: ``python -I -u _sandbox_child.py CONFIG_JSON`` (standard library only).

It stands between the worker and the trainer (docs/tools.md, "Threat model", layer 1): a child subreaper, and
the only holder of the trainer's pipes, which checks each answer before it answers the trainer.
"""

import json
import os
import select
import shutil
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _sandbox_isolation as isolate  # noqa: E402 - sibling files, found through the line above
import _sandbox_protocol as protocol  # noqa: E402
import _sandbox_worker as worker  # noqa: E402
sys.path.pop(0)


class _Stop(Exception):
    """SIGTERM, or the trainer is gone."""


def _stop(signum, frame):
    raise _Stop()


def _descendants(ancestor: int) -> list:
    """Live (not zombie) descendants of ``ancestor``, from every process's parent in /proc."""
    children = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
            try:
                state, ppid = os.read(fd, 512).rsplit(b")", 1)[1].split()[:2]  # after "pid (comm)"
            finally:
                os.close(fd)
        except (OSError, ValueError):  # gone meanwhile
            continue
        if state not in (b"Z", b"X"):
            children.setdefault(int(ppid), []).append(int(name))
    found, todo = [], [ancestor]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


class Launcher:
    def __init__(self, cfg: dict, pid: int, requests: int, answers: int, parent: int):
        self.cfg, self.pid, self.requests, self.answers, self.parent = cfg, pid, requests, answers, parent
        self.exit = None  # the worker's (wait status, rusage) once reaped
        self.buffer = bytearray()
        try:
            self.pidfd = os.pidfd_open(pid)  # Linux >= 5.3: readable when the worker exits
        except (AttributeError, OSError):
            self.pidfd = None

    def serve(self) -> None:
        ready = self._answer(protocol.READY_CAP)
        if ready is None or ready.get("ready") is not True or not isinstance(ready.get("isolation"), dict):
            return self._end(self._why())
        protocol.write_frame(self.cfg["rep_fd"], {"ready": True, "isolation": ready["isolation"]})
        number = 0
        while True:
            request = self._request()
            if request is None:
                return
            number += 1
            try:
                os.kill(self.pid, signal.SIGCONT)
                protocol.write_frame(self.requests, {"k": number, **request})
            except OSError:
                return self._end(self._why())
            answer = self._answer(protocol.cell_cap(request["max_output_chars"]))
            if answer is None:
                return self._end(self._why())
            stopped = self._stop_worker()
            self.kill_tree(spare=self.pid)
            result = protocol.cell_result(answer, request["max_output_chars"], number)
            if result is None or not stopped or self._more():
                return self._end("its answer to the sandbox was not valid (a cell wrote on the sandbox's own "
                                 "pipe, or stopped the interpreter); it was stopped")
            error, cut, tail = result
            protocol.write_frame(self.cfg["rep_fd"], {"error": error, "cut": cut, "tail": tail})

    def _request(self):
        """The trainer's next request; None when it closed its pipe."""
        while not select.select([self.cfg["req_fd"]], [], [], 1.0)[0]:
            if os.getppid() != self.parent:
                raise _Stop()
        return protocol.read_frame(self.cfg["req_fd"])

    def _answer(self, cap: int):
        """The worker's next message (``{}`` when unreadable); None when it exited or closed its pipe first."""
        while True:
            message = protocol.take_frame(self.buffer, cap)
            if message is not None:
                return message
            if self._reaped():
                return None
            watch = [self.answers] + ([self.pidfd] if self.pidfd is not None else [])
            ready = select.select(watch, [], [], 0.25 if self.pidfd is not None else 0.05)[0]
            if os.getppid() != self.parent:
                raise _Stop()
            if self.answers in ready:
                chunk = os.read(self.answers, 1 << 16)
                if not chunk:  # the worker is exiting, or closed its end: its status says which
                    deadline = time.monotonic() + 1.0
                    while not self._reaped() and time.monotonic() < deadline:
                        time.sleep(0.005)
                    return None
                self.buffer += chunk

    def _more(self) -> bool:
        """True when the worker wrote more than its answer (read with the worker stopped)."""
        if self.buffer:
            return True
        return bool(select.select([self.answers], [], [], 0)[0])

    def _stop_worker(self) -> bool:
        """SIGSTOP the worker and wait until it has stopped (False if it exited instead)."""
        try:
            os.kill(self.pid, signal.SIGSTOP)
            _, status, usage = os.wait4(self.pid, os.WUNTRACED)
        except OSError:
            return False
        if not os.WIFSTOPPED(status):
            self.exit = (status, usage)
        return os.WIFSTOPPED(status)

    def _reaped(self) -> bool:
        if self.exit is None:
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self.exit = (status, usage)
        return self.exit is not None

    def kill_tree(self, spare=None) -> None:
        """SIGKILL every descendant but ``spare`` until none is left, and reap them (the worker too,
        keeping its status)."""
        for _ in range(1000):
            victims = [pid for pid in _descendants(os.getpid()) if pid != spare]
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            while True:
                try:
                    pid, status, usage = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if not pid:
                    break
                if pid == self.pid and self.exit is None:
                    self.exit = (status, usage)
            if not victims:
                return
            time.sleep(0.001)

    def _why(self) -> str:
        """Why the worker is gone, from its wait status and CPU time (killed first if it is not)."""
        if self.exit is None:
            self.kill_tree()
            return "the interpreter stopped answering (it closed the sandbox's pipe); it was stopped"
        status, usage = self.exit
        if os.WIFEXITED(status):
            return f"the interpreter exited (code {os.WEXITSTATUS(status)})"
        signo, hard = os.WTERMSIG(status), worker.cpu_hard_limit(self.cfg)
        cpu = usage.ru_utime + usage.ru_stime if usage is not None else 0.0
        name = signal.Signals(signo).name if signo in signal.valid_signals() else f"signal {signo}"
        if signo == signal.SIGXCPU or (signo == signal.SIGKILL and cpu >= hard - 0.5):
            limit = (f"the session's CPU time limit of {hard} s ({worker.SESSION_CPU_CELLS} cells' worth)"
                     if self.cfg["stateful"] and signo == signal.SIGKILL else
                     f"its CPU time limit of {self.cfg['cpu_time_s']:g} s")
            return f"the interpreter was killed by {name}: over {limit}"
        return f"the interpreter was killed by {name}"

    def _end(self, why: str) -> None:
        self.kill_tree()
        try:
            protocol.write_frame(self.cfg["rep_fd"], {"ended": why})
        except OSError:
            pass


def main() -> None:
    cfg = json.loads(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    signal.signal(signal.SIGTERM, _stop)
    isolate.call("prctl", isolate.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    root = os.geteuid() == 0
    isolation = isolate.unshare(root) if cfg["isolate"] else {}
    isolation["subreaper"] = True
    code_r, code_w = os.pipe()
    answer_r, answer_w = os.pipe()
    parent = os.getppid()
    pid = os.fork()  # the only fork: after unshare(CLONE_NEWPID) the first child is PID 1 of the namespace
    if pid == 0:
        try:
            for fd in (cfg["req_fd"], cfg["rep_fd"], code_w, answer_r):  # the trainer's pipes stay out of reach
                os.close(fd)
            worker.main(cfg, isolation, root, code_r, answer_w)
        except BaseException:  # noqa: BLE001 - a failed setup: fd 2 is still the trainer's output pipe
            traceback.print_exc()
        finally:
            os._exit(70)
    os.close(code_r)
    os.close(answer_w)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    launcher = Launcher(cfg, pid, code_w, answer_r, parent)
    try:
        launcher.serve()
    except (_Stop, OSError):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        launcher.kill_tree()
        if os.getppid() != parent:  # orphaned: nobody else will remove the working directory
            shutil.rmtree(cfg["workdir"], ignore_errors=True)
    os._exit(0)


if __name__ == "__main__":
    main()
