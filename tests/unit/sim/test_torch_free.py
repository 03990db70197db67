"""A sim worker imports no torch: its entry modules, and a hand-off through the real
transports between two sim engines, run in a fresh interpreter that then lists the torch
modules it holds (none). ``tests/integration/test_sim_footprint.py`` checks the running
worker processes themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from pdserve.transfer.janitor import SHM_DIR

ROOT = Path(__file__).resolve().parents[3]

ENTRY = """
import json, sys
import services.prefill.__main__, services.decode.__main__
import pdserve.sim.backend, pdserve.worker.runtime
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "torch")))
"""

HANDOFF = """
import asyncio, json, sys
from pathlib import Path
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.sim.backend import SimOptions, sim_compute
from pdserve.transfer.compress import Compression
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.writer import SegmentWriter
from pdserve.transfer.stream.frames import FrameCollector, LayerCopy
from pdserve.transfer.stream.header import StreamHeader

model, prefix = Path(sys.argv[1]), sys.argv[2]
options = SimOptions.parse("roofline:h100:llama-3-8b", time_scale=1e-6)
prefill = Engine.from_pretrained(model, compute=sim_compute(options))
decode = Engine.from_pretrained(model, compute=sim_compute(options))
prompt = [16 + (7 * i) % 200 for i in range(40)]
params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
(whole,) = prefill.generate([prompt], params)
prefill.add_request("h", prompt, params.first_token_only(), hold_kv=True)
first = None
while prefill.has_unfinished():
    for out in prefill.step():
        first = first or (out.new_token_ids[0], 0.0)
payload = prefill.export_kv("h")
prefill.release_kv("h")
# Through shm (hash and copy into the segment, mapped and checked by the reader) ...
writer = SegmentWriter(prefix=prefix)
writer.begin("h", payload.layout, payload.num_tokens)
for i in range(payload.layout.num_layers):
    writer.send_layer(i, payload.keys[i], payload.values[i])
got = asyncio.run(SegmentReader().receive(writer.finish(), timeout_s=10.0))
# ... then as stream frames, int8-compressed and not.
streams = []
for compression in (Compression.NONE, Compression.INT8):
    collector = FrameCollector(StreamHeader("h", got.layout, got.num_tokens, compression))
    for i in range(got.layout.num_layers):
        for piece in LayerCopy.take(i, got.keys[i], got.values[i]).seal(1 << 20, compression):
            collector.feed(bytes(piece[2] if len(piece) > 2 else b"") + bytes(piece[0]))
    streams.append(collector.build())
decode.add_request("h", prompt, params, kv=streams[0], first_token=first)
tokens = [first[0]]
while decode.has_unfinished():
    for out in decode.step():
        tokens += out.new_token_ids
print(json.dumps({
    "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch"),
    "same_tokens": tokens == whole.token_ids,
    "int8_layers": len(streams[1].keys),
}))
"""


def _run(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_worker_entry_modules_import_no_torch() -> None:
    assert json.loads(_run(ENTRY)) == []


def test_a_sim_hand_off_through_the_transports_needs_no_torch(tiny_llama_dir: Path) -> None:
    prefix = f"pdserve-simtest-{uuid.uuid4().hex[:10]}-"
    result = json.loads(_run(HANDOFF, str(tiny_llama_dir), prefix))
    assert result == {"torch": [], "same_tokens": True, "int8_layers": 32}
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]  # nothing left
