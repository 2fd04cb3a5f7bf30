"""`kvproto.index.warm_up()` compiles every kernel signature a replica uses, checked in a fresh interpreter
(numba's compiled signatures are per process, so the check cannot share the test process)."""

from __future__ import annotations

import subprocess
import sys

_WARM_UP_CHECK = """
import numpy as np
from kvproto import index, index_kernels
from kvproto.codec import decode_entry, encode_entry
from kvproto.state import DirectoryState, Publish, Register, Remove, new_epoch_base

kernels = (index_kernels._home, index_kernels._main_row, index_kernels._locate, index_kernels._prefix_match)
index.warm_up()
warmed = [list(k.signatures) for k in kernels]

# What a replica does: commands arrive parsed by the API (leader) or decoded from the Raft log (followers).
state = DirectoryState()
epoch = state.apply(Register("n", "i", "http://127.0.0.1:9", epoch_base=new_epoch_base(7))).value
hashes = np.fromiter(range(1, 101), dtype=np.uint64, count=100)
slots = np.fromiter(range(100), dtype=np.uint32, count=100)
for cmd in (Publish("n", epoch, hashes, slots), Publish("n", epoch, hashes[:1], slots[:1])):
    state.apply(decode_entry(encode_entry([cmd]))[0])
    state.apply(cmd)
state.index.merge()
for with_slots in (True, False):
    state.lookup(np.asarray(list(range(1, 20)), dtype=np.uint64), with_slots)
    state.lookup(np.fromiter([5], dtype=np.uint64, count=1), with_slots)
state.apply(decode_entry(encode_entry([Remove("n", epoch, hashes[:7])]))[0])
state.apply(Remove("n", epoch, hashes[7:9]))
after = [list(k.signatures) for k in kernels]
assert after == warmed, (warmed, after)
print("ok", sum(map(len, warmed)))
"""


def test_warm_up_compiles_every_signature_a_replica_uses():
    """A kernel compiled later would run its compile on the Raft thread and stall heartbeats."""
    out = subprocess.run([sys.executable, "-c", _WARM_UP_CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok ")
