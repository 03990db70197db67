"""vLLM's CPU build as a benchmark peer, run in its own interpreter (``--vllm-python``).

vLLM pins its own torch and transformers, so it lives in a separate virtualenv; this module
starts ``vllm_worker.py`` there and speaks line-delimited JSON with it (see that module). The
worker times ``LLM.generate`` itself, so the pipe's latency is not measured.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve_bench.measure import PeerError, Workload

WORKER = Path(__file__).with_name("vllm_worker.py")
STARTUP_TIMEOUT_S = 900.0
"""vLLM takes ~36 s to start on 2 cores with enforce_eager; allow for a loaded machine."""
CALL_TIMEOUT_S = 900.0
KV_CACHE_GIB = 2
"""``VLLM_CPU_KVCACHE_SPACE``: the KV pool in GiB (the benchmark needs well under 1 GiB)."""


def vllm_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: ``threads`` OpenMP threads bound to cores 0..threads-1."""
    env = dict(os.environ if base is None else base)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
        HF_HUB_OFFLINE="1",  # local checkpoint only: never reach for a hub
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env.pop("PYTHONPATH", None)  # this interpreter's packages must not shadow the venv's
    return env


class VllmPeer:
    """``vllm.LLM(...).generate`` in a subprocess; ``log_path`` keeps its stderr."""

    name = "vllm"

    def __init__(
        self,
        python: str | Path,
        model_dir: str | Path,
        workload: Workload,
        *,
        dtype: str,
        threads: int,
    ) -> None:
        if not Path(python).is_file():
            raise InvalidArgumentError("vllm_python", f"{python} is not a file")
        budget = max(workload.max_context, workload.max_batch * workload.decode_prompt_len)
        cmd = [
            str(python),
            str(WORKER),
            "--model",
            str(Path(model_dir).resolve()),
            "--dtype",
            dtype,
            "--max-model-len",
            str(workload.max_context),
            "--max-num-seqs",
            str(workload.max_batch),
            "--max-num-batched-tokens",
            str(budget),
        ]
        fd, log = tempfile.mkstemp(prefix="pdserve-bench-vllm-", suffix=".log")
        self.log_path = Path(log)
        with os.fdopen(fd, "wb") as log_file:  # the child keeps its own descriptor
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=vllm_env(threads),
                text=True,
                cwd=tempfile.gettempdir(),  # not the repo: keep `import vllm` from seeing it
            )
        try:
            ready = self._read(STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.startup_s = float(ready["startup_s"])
        self.version = str(ready["vllm_version"])

    def _stream(self, name: str) -> IO[str]:
        stream = getattr(self._proc, name)
        if stream is None:
            raise WorkerUnavailableError("vLLM worker has no pipe")
        return stream

    def _log_tail(self, lines: int = 25) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _read(self, timeout: float) -> dict[str, Any]:
        out = self._stream("stdout")
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise WorkerUnavailableError(
                    f"vLLM worker sent nothing for {timeout:.0f} s; "
                    f"log {self.log_path}:\n{self._log_tail()}"
                )
        line = out.readline()
        if not line:
            code = self._proc.wait()
            raise WorkerUnavailableError(
                f"vLLM worker exited ({code}); log {self.log_path}:\n{self._log_tail()}"
            )
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise PeerError(f"{reply.get('error')}; log {self.log_path}:\n{self._log_tail()}")
        return reply

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        stdin = self._stream("stdin")
        stdin.write(
            json.dumps({"op": "generate", "prompts": prompts, "max_tokens": max_tokens}) + "\n"
        )
        stdin.flush()
        return float(self._read(CALL_TIMEOUT_S)["seconds"])

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                stdin = self._stream("stdin")
                stdin.write(json.dumps({"op": "exit"}) + "\n")
                stdin.close()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()  # it would not stop by itself; this is our own child
                self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()
