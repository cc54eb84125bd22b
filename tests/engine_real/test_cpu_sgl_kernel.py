"""kvroute's CPU stand-in for ``sgl_kernel`` (``scripts/cpu_sgl_kernel``), in the engine
virtualenv where it is installed: each function against its definition, written out plainly.

The serving tests then check the whole path: SGLang's greedy answers on a CPU equal plain
transformers' for the same model (``test_sglang_serving.py``).
"""

from __future__ import annotations

import subprocess

from kvroute.engine_launch import engine_python

CHECKS = r"""
import torch
import torch.nn.functional as F
import sgl_kernel

assert sgl_kernel.KVROUTE_CPU_STAND_IN
g = torch.Generator().manual_seed(0)

# assign_req_to_token_pool_cpu: request r writes the next (end - start) slots of
# out_cache_loc, in request order, into row pool[r] at [start, end).
req_to_token = torch.zeros((6, 40), dtype=torch.int32)
pool = torch.tensor([4, 0, 2])
start = torch.tensor([0, 5, 17])
end = torch.tensor([7, 5, 30])
out = torch.randint(1, 10_000, (int((end - start).sum()),), generator=g)
want = req_to_token.clone()
k = 0
for r, s, e in zip(pool.tolist(), start.tolist(), end.tolist()):
    for j in range(s, e):
        want[r, j] = int(out[k])
        k += 1
sgl_kernel.assign_req_to_token_pool_cpu(pool, req_to_token, start, end, out, 40)
assert torch.equal(req_to_token, want)

# copy_all_layer_kv_cache_cpu: in every buffer, row src[j] onto row tgt[j] (reads first).
bufs = [torch.randn((16, 8), generator=g).to(torch.bfloat16) for _ in range(3)]
wants = [b.clone() for b in bufs]
tgt, src = torch.tensor([3, 9, 1]), torch.tensor([1, 3, 12])
for w in wants:
    w[tgt] = w[src].clone()
ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
assert all(torch.equal(b, w) for b, w in zip(bufs, wants))

# act_and_mul: act(first half) * second half, into out when given.
x = torch.randn((5, 12), generator=g)
for name, act in (
    ("silu_and_mul", F.silu),
    ("gelu_and_mul", F.gelu),
    ("gelu_tanh_and_mul", lambda a: F.gelu(a, approximate="tanh")),
):
    fn = getattr(sgl_kernel, name)
    want = act(x[:, :6]) * x[:, 6:]
    assert torch.allclose(fn(x), want)
    buf = torch.empty((5, 6))
    assert fn(x, out=buf) is buf and torch.allclose(buf, want)

# Anything else fails when called, naming the stand-in.
try:
    sgl_kernel.fused_add_rmsnorm(x)
except NotImplementedError as exc:
    assert "stand-in" in str(exc)
else:
    raise AssertionError("an unknown kernel did not fail")
try:
    import sgl_kernel.kvcacheio  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("a submodule exists")
print("ok")
"""


def test_stand_in_functions_match_their_definitions() -> None:
    done = subprocess.run(
        [str(engine_python("sglang")), "-c", CHECKS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
