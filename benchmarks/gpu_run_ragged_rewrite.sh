#!/usr/bin/env bash
# One device call: dynjax.jit(ragged_dot="kernels") on the public MoE as written, beside the
# same model with lax.ragged_dot and with route.ragged_dot (bench_moe_public, one process),
# then a training step (value and grads) under padding="auto": lax / rewritten / route.
source benchmarks/_gpu_head.sh
[ "${TRAIN_ONLY:-0}" = 1 ] || python3 benchmarks/bench_moe_public.py --modes auto,auto+route,auto+kernels,trust,trust+kernels \
  --out "$OUT" 2>&1 | tee "$OUT/bench_moe_public_kernels.log"
python3 - <<'PY' 2>&1 | tee "$OUT/ragged_rewrite_train.log"
import time, numpy as np, jax, jax.numpy as jnp, dynjax
from dynjax import route
print("jax", jax.__version__, jax.devices()[0].device_kind)
rng = np.random.default_rng(0)
E, D, F = 8, 1024, 4096
gate = jnp.asarray(rng.normal(size=(D, E)), jnp.bfloat16)
w1 = jnp.asarray(rng.normal(size=(E, D, F)) / 32, jnp.bfloat16)
w2 = jnp.asarray(rng.normal(size=(E, F, D)) / 64, jnp.bfloat16)
def moe(x, a, b, dot):
  e = jnp.argmax(x @ gate, axis=-1); order = jnp.argsort(e); s = jnp.bincount(e, length=E)
  y = dot(jax.nn.silu(dot(x[order], a, s)), b, s)
  return jnp.zeros_like(y).at[order].set(y)
def step(x, a, b, dot):
  return jax.value_and_grad(lambda a, b: jnp.sum(moe(x, a, b, dot).astype(jnp.float32) ** 2), (0, 1))(a, b)
xs = [jax.device_put(jnp.asarray(rng.normal(size=(t, D)), jnp.bfloat16)) for t in (2600, 3000)]
dims = {"x": "t, 1024", "a": None, "b": None}
bk = {"t": dynjax.buckets.pow2(min=256, max=8192)}
fs = {"jax.jit exact lax": jax.jit(lambda x, a, b: step(x, a, b, jax.lax.ragged_dot))}
for name, dot, opt in (("auto lax", jax.lax.ragged_dot, None), ("auto lax + ragged_dot='kernels'", jax.lax.ragged_dot, "kernels"),
                       ("auto route.ragged_dot", route.ragged_dot, None)):
  fs[name] = dynjax.jit(lambda x, a, b, dot=dot: step(x, a, b, dot), dims=dims, buckets=bk, ragged_dot=opt, on_fallback="error")
want = fs["jax.jit exact lax"](xs[1], w1, w2)
for name, f in fs.items():
  for _ in range(40):
    for x in xs: jax.block_until_ready(f(x, w1, w2))
  ts = []
  for i in range(60):
    t0 = time.perf_counter(); jax.block_until_ready(f(xs[i % 2], w1, w2)); ts.append(time.perf_counter() - t0)
  got = f(xs[1], w1, w2)
  err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-30)) for a, b in zip(got[1], want[1]))
  print(f"{name}: median {np.median(ts)*1e3:.3f} ms (grad rel err {err:.1e})", flush=True)
  if name != "jax.jit exact lax" and "kernels" in name:
    print("\n".join(l for l in f.explain().splitlines() if "ragged_dot" in l and ("route" in l or "left" in l))[:2000])
PY
