"""Compiling a guide, and trying each new one in a child process first (``GuideProbe``).

A guide is text from the network, and xgrammar's compiler is C++: some grammars crash it
(0.2.8 ends its process with a segmentation fault on ``root ::= root {2}``) or could keep it
busy for good. So before a worker compiles a guide it has not seen, a child process (``python
-m pdserve.engine.guide_probe``, started with the first guided request, fed one JSON line per
guide) compiles it for a vocabulary of a hundred characters: the same grammar, in a
millisecond or two. A guide that kills the child, or takes longer than ``PROBE_TIMEOUT_S``,
is refused naming its field, and the next guide starts a new child; one the child cannot
compile is refused with its message; the worker compiles the rest for its real vocabulary.

``compile_with`` (how each kind of guide compiles) and ``compile_message`` (xgrammar's errors,
cleaned) serve both processes; nothing here imports torch or xgrammar at import time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import IO, Any

from pdserve.engine.guide import JSON_OBJECT_SCHEMA, Guide, GuideKind
from pdserve.errors import InvalidArgumentError

JSON_WHITESPACE = 20
"""Whitespace characters JSON output may hold between two of its elements: enough for
pretty-printing (a newline and the indent of a few levels), few enough that a model which
favours whitespace cannot spend its whole ``max_tokens`` on it (unbounded, a greedy one loops
there for ever)."""
PROBE_TIMEOUT_S = 10.0
"""A guide the probe has not compiled in this long is refused (its process is replaced)."""
PROBE_START_S = 120.0
"""How long the probe may take to start (it imports torch and xgrammar) on top of that."""
EXIT_WAIT_S = 5.0
"""How long a child whose output ended is given to exit, so its exit status is known."""

# xgrammar's errors come from its C++ core as "[12:00:00] /path/file.cc:123: <message>", some
# with a "Check failed: (...) is false: " in front of the message.
_CORE_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (?:Check failed: .*? is false: )?")
_MAX_MESSAGE_CHARS = 400
_READY = "ready"


def compile_with(compiler: Any, guide: Guide) -> Any:
    """``guide`` compiled by an ``xgrammar.GrammarCompiler``: a choice as the EBNF grammar of
    its strings, a JSON object as the schema of any object, JSON whitespace bounded."""
    kind = guide.kind
    if kind in (GuideKind.JSON, GuideKind.JSON_OBJECT):
        schema = guide.spec if kind is GuideKind.JSON else JSON_OBJECT_SCHEMA
        return compiler.compile_json_schema(schema, max_whitespace_cnt=JSON_WHITESPACE)
    if kind is GuideKind.REGEX:
        return compiler.compile_regex(guide.spec)
    if kind is GuideKind.CHOICE:
        return compiler.compile_grammar(guide.ebnf())
    return compiler.compile_grammar(guide.spec)


def compile_message(err: BaseException) -> str:
    """xgrammar's error text without its source location, on one line, bounded."""
    if isinstance(err, UnicodeDecodeError):  # its message was cut inside a character
        return "does not compile (the grammar library's message about it is unreadable)"
    text = " ".join(_CORE_PREFIX.sub("", str(err)).split())
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


class GuideProbe:
    """The child process that compiles each new guide first (see the module docstring);
    thread-safe, one guide at a time. The child ends when this object goes (or its parent
    does: its input closes)."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._ready = False
        self.started = 0
        """Child processes started so far (one more after each that a guide killed)."""

    def start(self) -> None:
        """Start the child if none runs, without waiting for it (it loads meanwhile)."""
        with self._lock:
            self._start()

    def check(self, guide: Guide) -> None:
        """Compile ``guide`` in the child; ``InvalidArgumentError`` naming the guide's field
        when it does not compile there, crashes the child or outlasts the timeout."""
        field = guide.kind.field
        request = {"kind": guide.kind.value, "spec": guide.spec, "choices": list(guide.choices)}
        with self._lock:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            deadline = time.monotonic() + self.timeout_s + (0.0 if self._ready else PROBE_START_S)
            reply: str | None = None
            died = False
            try:
                if not self._ready:
                    self._ready = _read_line(proc.stdout, deadline) == _READY
                if self._ready:
                    proc.stdin.write(json.dumps(request) + "\n")
                    proc.stdin.flush()
                    reply = _read_line(proc.stdout, deadline)
            except (OSError, EOFError):  # its pipe broke or its output ended: it died
                died = True
            if reply is None:
                if died:  # its exit status, not the kill's below
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=EXIT_WAIT_S)
                self._stop()
                why = (
                    f"crashes the grammar library's compiler (exit status {proc.returncode})"
                    if died
                    else f"did not compile within {self.timeout_s:g} s"
                )
                raise InvalidArgumentError(field, why)
        answer = json.loads(reply)
        if "error" in answer:
            raise InvalidArgumentError(field, str(answer["error"]))

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # where this pdserve is importable
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.engine.guide_probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # xgrammar's warnings about each guide
            text=True,
            env=env,
        )
        self._ready = False
        self.started += 1
        weakref.finalize(self, _end, self._proc)
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            _end(self._proc)
        self._proc = None
        self._ready = False


def _end(proc: subprocess.Popen[str]) -> None:
    """Stop a child and reap it (its input closed first: it ends on its own)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _read_line(pipe: IO[str], deadline: float) -> str | None:
    """The next line the child writes (it writes whole lines), or None when the deadline
    passes first; ``EOFError`` when its output ends (it died). The end of its output is the
    sign, not ``poll()``: a process closes its pipes before the kernel has its exit status."""
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([pipe], [], [], left)[0]:
        return None
    line = pipe.readline()
    if not line:
        raise EOFError("the probe's output ended")
    return line.rstrip("\n")


def main() -> None:
    """The child: compile each guide read from stdin for a small vocabulary, answer each on
    stdout (``{"ok": true}`` or ``{"error": message}``); end with stdin."""
    import xgrammar as xgr

    vocab = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\u00e9", "\u6771", "</s>"]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[len(vocab) - 1])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    print(_READY, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        guide = Guide(GuideKind(request["kind"]), request["spec"], tuple(request["choices"]))
        try:
            compile_with(compiler, guide)
            answer: dict[str, object] = {"ok": True}
        except (RuntimeError, ValueError) as err:
            answer = {"error": compile_message(err)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
