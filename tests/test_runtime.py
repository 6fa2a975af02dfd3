"""The process after posenc kernels ran: one OpenMP runtime, and it is torch's own.

posenc_torch's OpenMP code must share the runtime that torch's wheel ships (two runtimes in
one process oversubscribe the cores and can crash).  Checked in a fresh interpreter (nothing
else loaded a runtime first), after kernel calls large enough to run their OpenMP loops on
two threads (past PE_SERIAL_ELEMENTS), from the shared objects mapped into it
(/proc/self/maps).  `make compat` runs this file under a second torch release too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = r"""
import json, re
import torch
import posenc_torch as pt

torch.set_num_threads(2)
q = torch.randn(2, 512, 28, 128)
cos = torch.randn(2, 512, 128)
pt.apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, cos)
pt.apply_rope(q.transpose(1, 2), q.transpose(1, 2), torch.arange(512)[None],
              torch.rand(64))
torch.ops.posenc.rope(q, q, cos, cos, [], False, 0, False)  # the op alone, (B, T, H, D)
runtime = re.compile(r"lib(g|i|l)?omp[^/]*\.so")
mapped = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split()
        if len(parts) >= 6 and runtime.search(parts[5].rsplit("/", 1)[-1]):
            mapped.add(parts[5])
print(json.dumps({"runtimes": sorted(mapped), "torch": torch.__file__}))
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(),
                    reason="reads /proc/self/maps (Linux only)")
def test_one_openmp_runtime_and_it_is_torchs():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    runtimes = info["runtimes"]
    assert len(runtimes) == 1, f"expected exactly one OpenMP runtime, found {runtimes}"
    torch_dir = Path(info["torch"]).resolve().parent
    lib = Path(runtimes[0]).resolve()
    # torch's wheels keep it in torch/lib or in the auditwheel folder torch.libs beside it
    owners = (torch_dir, torch_dir.parent / "torch.libs")
    assert any(lib.is_relative_to(d) for d in owners), \
        f"the OpenMP runtime {lib} is not the one shipped with torch ({torch_dir})"
